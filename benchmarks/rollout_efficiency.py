"""Rollout efficiency: the rollout worker's generated tokens/s against vLLM's own `LLM.generate` with the same engine
settings, prompts, seeds and lengths, in one run (docs/rollout_efficiency.md has the figures).

    python benchmarks/rollout_efficiency.py                   # the long-CoT demo's model and engine, 128 samples
    python benchmarks/rollout_efficiency.py --samples 256 --rounds 3 --profile worker.prof

Worker path (measured): a `RolloutWorker` built in-process from deploy/configs/demo_longcot.yaml (its engine
settings, its `_sampling_params` seeds, the weight-probe wrapper of weight_sync.verify_every) and, per engine step,
the body of `RolloutWorker.run` that generates: `DecodeLoop.step` (one engine step, version stamping, log-probs,
`Trajectory` and group assembly), the loop's counters, and the hand-over of each finished group (`RolloutWorker._put`, then the one serialization of the controller's take) to a stand-in
reward worker that pickles it (what Ray serializes for the call). Not measured: the Ray call itself, the controller's
`sync` and `watch` (once per batch of groups, not per step) and weight loads. Baseline: `LLM.generate` on a second,
identically configured `LLM` with the same requests, each forced to the length the worker path produced
(`forced_length_params`). The two run step by step at the same time (`interleaved`), so both see the same load on
this shared machine; the engines swap paths each round.
"""

import argparse
import cProfile
import os
import pickle
import statistics
import time

from protocols.config import RunConfig, load_config

WORKER, BASELINE = "worker", "LLM.generate"


def forced_length_params(params, length: int):
    """A copy of vLLM `SamplingParams` that generates exactly `length` tokens: `max_tokens=length`, EOS ignored (the
    same seed then samples the same tokens, and the count holds even where a draw differs)."""
    forced = params.clone()
    forced.max_tokens = length
    forced.ignore_eos = True
    return forced


def ratio_summary(worker_tps: list[float], baseline_tps: list[float]) -> dict[str, float]:
    """Median tokens/s of each path and the median of the per-round ratios worker / baseline."""
    ratios = [w / b for w, b in zip(worker_tps, baseline_tps)]
    return {"worker_tps": statistics.median(worker_tps), "baseline_tps": statistics.median(baseline_tps),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


class PicklingRewardWorker:
    """Stands in for a reward worker's actor handle: `score_group.remote(group)` serializes the group as Ray would
    for the call, and returns a token for the router to track."""

    def __init__(self) -> None:
        self.score_group = self
        self.bytes = 0

    def remote(self, group):
        self.bytes += len(pickle.dumps(group, protocol=5))
        return object()


def model_folder(cfg: RunConfig) -> str:
    """The cached warm-started long-CoT model; refused if it is not built (building it takes about 17 minutes)."""
    from demos.longcot_model import longcot_model_key
    from demos.model_cache import READY_MARKER, default_cache_dir

    folder = default_cache_dir() / longcot_model_key(cfg.model.demo, cfg.data)
    if not (folder / READY_MARKER).is_file():
        raise SystemExit(f"no cached long-CoT model at {folder}: build it first with `relayrl train --config "
                         "deploy/configs/demo_longcot.yaml` or `python benchmarks/longcot_lengths.py --model`")
    return str(folder)


class WorkerRun:
    """One pass of the worker path: every group started in the worker's decode loop, then `step()` runs one
    iteration of the generating part of `RolloutWorker.run` until `done`."""

    def __init__(self, worker, prompts, samples_per_prompt: int) -> None:
        self.worker, self.expected = worker, len(prompts) * samples_per_prompt
        self.reward = PicklingRewardWorker()
        self.stats = {"generate_s": 0.0, "tokens": 0, "groups": 0, "steps": 0}
        self.lengths: dict[tuple[str, int], int] = {}
        """(group id, sample index) -> response tokens."""
        # group ids as the controller names them (the seeds hash them), the same in every pass
        for i, prompt in enumerate(prompts):
            worker.decoding.start_group(f"bench/{i}", prompt)

    @property
    def done(self) -> bool:
        return not self.worker.decoding.has_unfinished()

    def step(self) -> None:
        stats = self.stats
        t0 = time.perf_counter()
        groups = self.worker.decoding.step(self.worker.version)
        stats["generate_s"] += time.perf_counter() - t0
        for group in groups:
            stats["groups"] += 1
            stats["tokens"] += sum(len(t.response_token_ids) for t in group.trajectories)
            for t in group.trajectories:
                self.lengths[(t.group_id, t.sample_index)] = len(t.response_token_ids)
            # the worker's hand-over: a header, the group kept in its outbox until the controller takes it,
            # which serializes it once (as the stand-in does here)
            self.worker._put(group)
            self.reward.remote(self.worker.outbox.pop(group.group_id))
        stats["steps"] += 1
        if self.done:
            assert len(self.lengths) == self.expected, (len(self.lengths), self.expected)


def drain(run: WorkerRun) -> WorkerRun:
    """Step `run` until its groups are done."""
    while not run.done:
        run.step()
    return run


def interleaved(llm, run_baseline, make_other, other_step) -> dict:
    """Run `run_baseline()` (a call that drives `llm.llm_engine.step` in its own loop, e.g. `LLM.generate`) while
    one step of the other path runs before each of its engine steps; the other path finishes alone after. Both see
    the machine's load at the same moments, so their ratio holds on a busy machine. Returns each path's wall and
    thread-CPU seconds (the other path's time is taken out of the baseline's) and the baseline's result."""
    engine = llm.llm_engine
    spent = {"wall": 0.0, "cpu": 0.0}

    def timed(fn):
        w, c = time.perf_counter(), time.thread_time()
        result = fn()
        spent["wall"] += time.perf_counter() - w
        spent["cpu"] += time.thread_time() - c
        return result

    other = timed(make_other)
    real_step = engine.step

    finished = [False]

    def advance():
        finished[0] = other.done  # the worker loop's own has-work check: on its side of the clock
        if not finished[0]:
            other_step(other)

    def step():
        if not finished[0]:
            timed(advance)
        return real_step()

    engine.step = step  # an instance attribute shadows the method for this call only
    try:
        before = dict(spent)
        w, c = time.perf_counter(), time.thread_time()
        result = run_baseline()
        wall, cpu = time.perf_counter() - w, time.thread_time() - c
    finally:
        del engine.step
    wall -= spent["wall"] - before["wall"]
    cpu -= spent["cpu"] - before["cpu"]
    while not other.done:
        timed(lambda: other_step(other))
    return {"baseline_wall": wall, "baseline_cpu": cpu, "other_wall": spent["wall"], "other_cpu": spent["cpu"],
            "result": result, "other": other}


def baseline_requests(worker, prompts, samples_per_prompt: int, lengths: dict[tuple[str, int], int]):
    """The worker's requests for `LLM.generate`: its prompt, its seeded sampling parameters, its length."""
    from actors.decode_loop import SampleInFlight

    inputs, params = [], []
    for i, prompt in enumerate(prompts):
        for index in range(samples_per_prompt):
            sample = SampleInFlight(f"bench/{i}", index, prompt, worker.cfg.rollout.max_response_tokens)
            length = lengths[(sample.group_id, index)]
            inputs.append({"prompt_token_ids": list(prompt.prompt_token_ids)})
            params.append(forced_length_params(worker._sampling_params(sample, length), length))
    return inputs, params


def markdown_table(rows: list[dict], summary: dict, cpu_summary: dict, steps: int) -> str:
    lines = ["| round | path | engine | tokens | wall s | tokens/s (wall) | CPU s | tokens/s (CPU) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['round']} | {r['path']} | {r['engine']} | {r['tokens']:,} | {r['wall']:.2f} | "
                     f"{r['tokens'] / r['wall']:,.0f} | {r['cpu']:.2f} | {r['tokens'] / r['cpu']:,.0f} |")
    lines += ["", "| time | worker tokens/s (median) | LLM.generate tokens/s (median) | ratio (median of rounds) | "
              "ratio range | worker overhead per engine step |", "| --- | --- | --- | --- | --- | --- |"]
    for name, s in (("wall", summary), ("thread CPU", cpu_summary)):
        lines.append(f"| {name} | {s['worker_tps']:,.0f} | {s['baseline_tps']:,.0f} | {s['ratio']:.3f} | "
                     f"{s['ratio_min']:.3f} to {s['ratio_max']:.3f} | {1e3 * s['overhead_s'] / steps:.3f} ms |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="deploy/configs/demo_longcot.yaml")
    parser.add_argument("--samples", type=int, default=128, help="samples per pass (groups of samples_per_prompt)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the two engines swap paths each round")
    parser.add_argument("--profile", default="", help="also profile one worker pass into this cProfile file")
    args = parser.parse_args()

    cfg = load_config(args.config)
    from actors.rollout_worker import RolloutWorker
    from rewards.datasets import load_prompts

    folder = model_folder(cfg)
    # two engines of the same settings: each round one runs the worker path, the other LLM.generate, step by step
    workers = [RolloutWorker(cfg, 0, folder), RolloutWorker(cfg, 0, folder)]
    g = cfg.rollout.samples_per_prompt
    prompts, _ = load_prompts(cfg.data, "train", workers[0].tokenizer)
    prompts = prompts[: max(1, args.samples // g)]
    print(f"model {folder}; {len(prompts)} groups x {g} samples; engine max_num_seqs={cfg.rollout.max_num_seqs}, "
          f"max_model_len={cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens}, dtype={cfg.model.dtype}, "
          f"enforce_eager={cfg.rollout.enforce_eager}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
          flush=True)

    # warm-up: the worker path once; its lengths are what LLM.generate is then forced to generate
    start = time.perf_counter()
    warm = drain(WorkerRun(workers[0], prompts, g))
    lengths, steps = warm.lengths, warm.stats["steps"]
    print(f"warm-up: {warm.stats['tokens']:,} tokens in {steps} steps, {time.perf_counter() - start:.1f} s; "
          f"groups pickled {warm.reward.bytes / 1e6:.2f} MB", flush=True)

    rows, per_round = [], []
    for r in range(args.rounds):
        worker, base = workers[r % 2], workers[1 - r % 2]
        inputs, params = baseline_requests(worker, prompts, g, lengths)
        out = interleaved(base.llm, lambda: base.llm.generate(inputs, params, use_tqdm=False),
                          lambda: WorkerRun(worker, prompts, g), WorkerRun.step)
        run = out["other"]
        if run.lengths != lengths:
            changed = sum(run.lengths[k] != v for k, v in lengths.items())
            print(f"round {r + 1}: {changed} worker lengths differ from the warm-up's", flush=True)
        base_tokens = sum(len(o.outputs[0].token_ids) for o in out["result"])
        rows.append({"round": r + 1, "path": WORKER, "engine": r % 2, "tokens": run.stats["tokens"],
                     "wall": out["other_wall"], "cpu": out["other_cpu"]})
        rows.append({"round": r + 1, "path": BASELINE, "engine": 1 - r % 2, "tokens": base_tokens,
                     "wall": out["baseline_wall"], "cpu": out["baseline_cpu"]})
        per_round.append((rows[-2], rows[-1]))
        print(rows[-2], rows[-1], sep="\n", flush=True)

    def summary(kind: str) -> dict:
        s = ratio_summary([w["tokens"] / w[kind] for w, _ in per_round], [b["tokens"] / b[kind] for _, b in per_round])
        return {**s, "overhead_s": statistics.median(w[kind] - b[kind] for w, b in per_round)}

    print(markdown_table(rows, summary("wall"), summary("cpu"), steps))

    if args.profile:
        run = WorkerRun(workers[0], prompts, g)
        profiler = cProfile.Profile()
        profiler.enable()
        drain(run)
        profiler.disable()
        profiler.dump_stats(args.profile)
        print(f"profile of one worker pass: {args.profile}")


if __name__ == "__main__":
    main()
