"""Where one addition-demo step of relayrl goes, beside a minimal plain-torch GRPO loop on the same model and batch
(issue 30, item 2). Measures only; docs/peers.md lists the cuts it points to.

Runs the `make train` job's driver (cluster/trainer.py Trainer, demo defaults) in this process with timers around
its phases: waiting for a batch, building the batch (TrainingBatch, shaping, advantages), the learner call, the
weight publish, the sync-check probe and comparison, and the per-step bookkeeping after the step (queue stats,
worker stats, metrics line). Ray's task timeline then gives the time each actor spent executing the calls the
driver waited on (`LearnerRank.train_step`, the publish), so the driver's wait minus the actor's execution is the
round trip: serialization, the object store, Ray's scheduling. After the job, in the same process with one torch
thread (a 1-CPU Ray actor's count), a plain-torch GRPO step on the same model folder and the batch the learner
last trained: generation with transformers `generate`, the verifier, advantages, and one AdamW step through
relayrl's own scoring and loss.

    nice -n 5 python benchmarks/step_profile.py --steps 60 --skip 10 --out runs/bench_step_profile [key=value ...]
"""

import argparse
import json
import signal
import subprocess
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class Phases:
    """Seconds per step and phase, from wrapped callables."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - t0
        return timed

    def next_step(self) -> None:
        self.rows.append(dict(self.current))
        self.current = defaultdict(float)


def profile_relayrl(steps: int, out: Path, overrides: list[str],
                    config: str | None = None) -> tuple[list[dict], dict, dict, object, dict]:
    import ray

    from cluster import trainer as trainer_module
    from protocols.config import load_config

    cfg = load_config(config, [f"train.steps={steps}", f"output_dir={out / 'run'}", "logging.plots=false", *overrides])
    trainer = trainer_module.Trainer(cfg)
    phases = Phases()
    captured = {}
    loop_marks: list[float] = []

    wait = trainer._wait_for_batch

    def wait_for_batch():
        loop_marks.append(time.perf_counter())
        if len(loop_marks) > 1:
            phases.next_step()
        return phases.wrap("wait", wait)()

    trainer._wait_for_batch = wait_for_batch
    step = trainer.step

    def timed_step(groups):
        t0 = time.perf_counter()
        metrics = step(groups)
        phases.current["step_call"] += time.perf_counter() - t0
        phases.current["step_end_at"] = time.perf_counter()
        return metrics

    trainer.step = timed_step
    learner_step = trainer.learner.train_step

    def train_step(batch, normalizer):
        captured["batch"], captured["normalizer"] = batch, normalizer
        return learner_step(batch, normalizer)

    trainer.learner.train_step = phases.wrap("learner", train_step)
    trainer.supervisor.publish_weights = phases.wrap("publish_learner", trainer.supervisor.publish_weights)
    trainer._score_probe = phases.wrap("probe", trainer._score_probe)
    trainer._check_weights = phases.wrap("check", trainer._check_weights)
    prepare = trainer_module.prepare_batch
    trainer_module.prepare_batch = phases.wrap("prepare", prepare)
    from_trajectories = trainer_module.TrainingBatch.from_trajectories
    trainer_module.TrainingBatch.from_trajectories = phases.wrap("batch_build", from_trajectories)
    pid = ray.get(trainer.learner.ranks[0].__ray_call__.remote(lambda self: os.getpid()))
    spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-r", "100",
                            "-f", "raw", "-o", str(out / "learner_stacks.txt"), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        t0 = time.perf_counter()
        summary = trainer.run()
        run_s = time.perf_counter() - t0
        # after the loop: the last step's row
        phases.next_step()
        events = ray.timeline()
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=60)
    finally:
        trainer_module.prepare_batch = prepare
        trainer_module.TrainingBatch.from_trajectories = from_trajectories
        trainer.shutdown()
    # bookkeeping after step(): from its end to the next wait's start
    rows = phases.rows
    for i, row in enumerate(rows[:-1]):
        if "step_end_at" in row and i + 1 < len(loop_marks):
            row["after_step"] = loop_marks[i + 1] - row["step_end_at"]
    for row in rows:
        row.pop("step_end_at", None)
    summary["run_s"] = run_s
    return rows, summary, captured, cfg, actor_seconds(events, steps)


def actor_seconds(events: list[dict], steps: int) -> dict[str, dict[str, float]]:
    """Per actor method (`cat` task::Class.method): calls, total and median seconds inside the actor, and the
    seconds of its phases there (task:deserialize_arguments, task:execute, task:store_outputs: the events Ray
    nests in the call on the same worker)."""
    by_worker: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_worker[str(e.get("tid"))].append(e)
    calls: dict[str, list[float]] = defaultdict(list)
    inner: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for worker_events in by_worker.values():
        outer = [e for e in worker_events if str(e.get("cat", "")).startswith("task::")]
        nested = [e for e in worker_events if str(e.get("cat", "")).startswith("task:")
                  and not str(e.get("cat", "")).startswith("task::")]
        for o in outer:
            name = str(o["cat"]).removeprefix("task::")
            calls[name].append(float(o["dur"]) / 1e6)
            end = o["ts"] + o["dur"]
            for e in nested:
                if o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end:
                    inner[name][str(e["cat"])] += float(e["dur"]) / 1e6
    return {name: {"calls": len(d), "total_s": sum(d), "median_s": statistics.median(d), **inner[name]}
            for name, d in sorted(calls.items(), key=lambda kv: -sum(kv[1]))}


LEARNER_BUCKETS = [
    ("collate", ("_collate",)),
    ("forward (score_responses)", ("score_responses",)),
    ("policy loss", ("compute_policy_loss",)),
    ("nonfinite agreement (all-reduce)", ("agree",)),
    ("ZeRO-2 gradient hooks, buckets and all-reduce", ("grad_handling_hook", "allreduce_gradients")),
    ("backward (autograd)", ("DeepSpeedEngine.backward",)),
    ("optimizer step (engine.step)", ("DeepSpeedEngine.step",)),
    ("grad norm read", ("get_global_grad_norm",)),
    ("step readings", ("_finish_step",)),
]
"""Where a sample inside LearnerRank.train_step goes: the first bucket one of whose functions is on its stack
(py-spy names a method Class.method)."""


def _frames(stack: str) -> list[tuple[str, str]]:
    """py-spy raw frames `function (file:line)` -> (function, file)."""
    out = []
    for frame in stack.split(";"):
        func, _, rest = frame.partition(" (")
        out.append((func.strip(), rest))
    return out


def learner_stacks(path: Path) -> dict[str, float]:
    """py-spy's collapsed stacks of the learner rank (100 samples a second, idle threads left out) -> seconds per
    bucket inside train_step, and in the rank's other calls."""
    out: dict[str, float] = defaultdict(float)
    if not path.is_file():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        seconds = int(count) / 100.0
        frames = _frames(stack)
        names = {f for f, _ in frames}
        if any(f.endswith("train_step") and "learner_actor" in where for f, where in frames):
            bucket = next((name for name, funcs in LEARNER_BUCKETS
                           if any(f == fn or f.endswith("." + fn) for fn in funcs for f in names)),
                          "other in train_step")
            out["train_step/" + bucket] += seconds
        elif any(f.endswith("publish_weights") for f in names):
            out["publish"] += seconds
        elif any(f.endswith("probe_logprobs") for f in names):
            out["probe_logprobs"] += seconds
        else:
            out["other"] += seconds
    return dict(sorted(out.items()))


def plain_grpo_step(cfg, folder: str, batch, normalizer, repeats: int) -> dict[str, float]:
    """One minimal GRPO step in plain torch on the same model and batch: generate, verify, advantages, AdamW step."""
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from learner.batch import collate, score_responses
    from learner.objective import PolicyLossInputs, compute_advantages, compute_policy_loss
    from rewards.registry import resolve_verifier
    from rewards.datasets import load_prompts

    torch.set_num_threads(1)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, weight_decay=0.0)
    prompts, _ = load_prompts(cfg.data, "train", tokenizer)
    verify = resolve_verifier(cfg.reward.verifier).fn  # the demos' verifiers are single-sample functions
    group, per_step = cfg.rollout.samples_per_prompt, cfg.learner.prompts_per_step
    train_batch = batch  # as the learner got it: shaped, with advantages (prepare_batch ran in the driver)
    times: dict[str, list[float]] = defaultdict(list)
    for rep in range(repeats + 1):
        chunk = prompts[rep * per_step:(rep + 1) * per_step]
        t0 = time.perf_counter()
        width = max(len(p.prompt_token_ids) for p in chunk)
        rows = [[tokenizer.pad_token_id] * (width - len(p.prompt_token_ids)) + p.prompt_token_ids
                for p in chunk for _ in range(group)]
        input_ids = torch.tensor(rows)
        with torch.no_grad():
            generated = model.generate(input_ids=input_ids, attention_mask=(input_ids != tokenizer.pad_token_id).long(),
                                       do_sample=True, temperature=cfg.rollout.temperature, top_k=0, top_p=1.0,
                                       max_new_tokens=cfg.rollout.max_response_tokens,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        t1 = time.perf_counter()
        texts = tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
        rewards = torch.tensor([verify(chunk[i // group], t).reward for i, t in enumerate(texts)])
        compute_advantages(rewards, generated[:, width:] != tokenizer.pad_token_id, group, cfg.algorithm)
        t2 = time.perf_counter()
        # The learner's step on the batch relayrl trained: relayrl's scoring and loss, torch AdamW.
        model.train()
        optimizer.zero_grad(set_to_none=True)
        sample = collate(train_batch, tokenizer.pad_token_id)
        logprobs, _ = score_responses(model, sample, cfg.rollout.temperature, cfg.learner.logits_chunk_tokens)
        inputs = PolicyLossInputs(behavior_logprobs=train_batch.behavior_logprobs, advantages=train_batch.advantages,
                                  loss_mask=train_batch.loss_mask, proximal_logprobs=logprobs.detach())
        loss, _ = compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.max_grad_norm)
        optimizer.step()
        model.eval()
        t3 = time.perf_counter()
        if rep:  # the first repeat warms up allocators and caches
            times["generate"].append(t1 - t0)
            times["reward_advantages"].append(t2 - t1)
            times["train"].append(t3 - t2)
            times["step"].append(t3 - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None,
                        help="the job's YAML (default: the addition demo; deploy/configs/demo_longcot.yaml: long-CoT)")
    parser.add_argument("--steps", type=int, default=60, help="steps of the relayrl job")
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the medians (start-up)")
    parser.add_argument("--plain-repeats", type=int, default=20, help="plain-torch steps measured (0: none)")
    parser.add_argument("--out", default="runs/bench_step_profile")
    parser.add_argument("overrides", nargs="*", help="relayrl overrides, section.key=value")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # Ray records its actors' per-call profile events (ray.timeline) only when this is set before it starts.
    os.environ["RAY_PROFILING"] = "1"

    rows, summary, captured, cfg, actors = profile_relayrl(args.steps, out, args.overrides, args.config)
    batch = captured["batch"]
    steady = rows[args.skip:-1]  # the last row holds the end-of-run sync check
    keys = ["wait", "batch_build", "prepare", "learner", "publish_learner", "probe", "check", "step_call",
            "after_step"]
    median = {k: statistics.median(r.get(k, 0.0) for r in steady) for k in keys}
    mean = {k: statistics.fmean(r.get(k, 0.0) for r in steady) for k in keys}
    median["publish_controller_and_rest"] = max(0.0, median["step_call"] - sum(
        median[k] for k in ("batch_build", "prepare", "learner", "publish_learner", "probe", "check")))
    from cluster.model_folder import resolve_model_path

    plain = (plain_grpo_step(cfg, resolve_model_path(cfg), batch, captured["normalizer"], args.plain_repeats)
             if args.plain_repeats else {})
    result = {"steps": args.steps, "skip": args.skip, "driver_median_s": median, "driver_mean_s": mean,
              "actor_methods": actors, "plain_torch_median_s": plain,
              "summary_phase_seconds": summary.get("phase_seconds"), "train_seconds": summary.get("train_seconds"),
              "samples_in_batch": int(batch.num_samples),
              "learner_rank_py_spy_s": learner_stacks(out / "learner_stacks.txt")}
    (out / "profile.json").write_text(json.dumps(result, indent=2))
    print("driver, median seconds per step over steps", args.skip + 1, "to", args.steps)
    for k, v in median.items():
        print(f"  {k:28s} {v:.4f}")
    print("actor methods (Ray timeline, inside the actor), top 12 by total:")
    for name, d in list(actors.items())[:12]:
        phases = ", ".join(f"{k.removeprefix('task:')} {v:.2f}" for k, v in d.items() if k.startswith("task:"))
        print(f"  {name[:40]:40s} calls {d['calls']:5d}  total {d['total_s']:7.2f} s  median {d['median_s']:.4f} s"
              f"  ({phases})")
    print("learner rank, py-spy seconds (whole run):")
    for k, v in result["learner_rank_py_spy_s"].items():
        print(f"  {k:50s} {v:.2f}")
    print("plain-torch GRPO step, median seconds:")
    for k, v in plain.items():
        print(f"  {k:28s} {v:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
