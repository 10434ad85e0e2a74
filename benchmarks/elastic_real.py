"""Real-stack benchmark: a scale-up of the rollout pool in a running demo job (two-digit addition, local Ray).

The job starts with `--workers` rollout workers; after step `--scale-at` the same request `relayrl scale RUN_DIR
--rollout-workers N` writes asks for `--to` workers, and the driver applies it between two steps. Prints:
- samples generated per second (every sample that reached the controller, trained or dropped) over the steps
  before the request and over the steps after the new workers' first samples, with the learner's wait share in each
  window (a learner that hardly waits bounds generation: more workers cannot raise it);
- the time from the request to each new worker's first sample (the controller's `first_scored_at`), split into the
  wait for the step to end, the resize (engine start, weight load; the learner trains on meanwhile, and the steps
  it trained are printed) and the new run's first group;
- how long the driver was held between two steps when the new engines joined (the `finish_grow` call that added
  them), against the median step.
    python benchmarks/elastic_real.py --steps 40 --scale-at 15 --to 2
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import ray

from cli.main import main as cli_main
from cluster.trainer import Trainer
from protocols.config import load_config


def window_rate(marks: list[tuple[int, float, int]], first: int, last: int, samples_per_group: int) -> float:
    """Samples per second between the ends of steps `first` and `last` (marks: (version, wall time, groups
    received by then))."""
    by_version = {v: (t, n) for v, t, n in marks}
    (t0, n0), (t1, n1) = by_version[first], by_version[last]
    return (n1 - n0) * samples_per_group / (t1 - t0)


def wait_share(rows: list[dict], first: int, last: int) -> float:
    """The learner's wait for data as a share of its step time, over the steps after `first` up to `last`."""
    window = [r for r in rows if first < r["step"] <= last]
    return sum(r["time/wait_s"] for r in window) / sum(r["time/step_s"] for r in window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--scale-at", type=int, default=15, help="the request is made after this step")
    parser.add_argument("--workers", type=int, default=1, help="rollout workers at the start")
    parser.add_argument("--to", type=int, default=2, help="rollout workers after the request")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the 'before' window")
    parser.add_argument("--settle", type=int, default=2,
                        help="steps after the new workers' first samples left out of the 'after' window")
    args, extra = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="relayrl_elastic_"))
    cfg = load_config(None, [f"output_dir={out}", f"train.steps={args.steps}", "data.num_eval_prompts=20",
                             "logging.plots=false", f"rollout.num_workers={args.workers}", *extra])
    trainer = Trainer(cfg)
    step, marks = trainer.step, []

    def step_then_mark(groups):
        metrics = step(groups)
        received = ray.get(trainer.controller.stats.remote())["queue/received"]
        marks.append((trainer.version, time.time(), int(received)))
        if trainer.version == args.scale_at:
            assert cli_main(["scale", str(out), "--rollout-workers", str(args.to), "--wait", "0"]) == 0
        return metrics

    pool, holds = trainer.pools["rollout"], []
    finish_grow = pool.finish_grow

    def timed_finish_grow(wait: bool = False):
        t0 = time.perf_counter()
        seconds = finish_grow(wait)
        # the call that added the engines between two steps; a grow still starting when the run stops is waited
        # for (`wait`, the pool's settle at stop): that wait is the run's end, not a hold between steps
        if seconds is not None and not wait:
            holds.append(time.perf_counter() - t0)
        return seconds

    pool.finish_grow = timed_finish_grow
    trainer.step = step_then_mark
    try:
        summary = trainer.run()
        first_scored = ray.get(trainer.controller.get_first_scored_at.remote())
        ids = trainer.supervisor.rollout_ids
    finally:
        trainer.shutdown()
    done = json.loads((out / "control" / "scale_done.json").read_text())
    if "error" in done:
        raise SystemExit(f"the scale request was refused: {done['error']}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_s = sorted(r["time/step_s"] for r in rows)
    median = steps_s[len(steps_s) // 2]
    if not holds:
        raise SystemExit("the new engines joined only when the run stopped (no join between two steps): "
                         "raise --steps")
    print(f"\ndriver held between two steps at the join: {max(holds):.2f} s (median step {median:.2f} s; "
          f"ratio {max(holds) / median:.2f})")
    new_ids = ids[args.workers:]
    if any(i not in first_scored for i in new_ids):
        raise SystemExit(f"new workers {[i for i in new_ids if i not in first_scored]} scored no group before the "
                         "run ended; raise --steps")
    firsts = {i: first_scored[i] - done["requested_at"] for i in new_ids}
    joined_at = max(first_scored[i] for i in new_ids)
    after_first = next(v for v, t, _ in marks if t >= joined_at) + args.settle
    if after_first >= args.steps:
        raise SystemExit(f"the new workers' first samples came after step {after_first - args.settle}: no steps left "
                         "to measure; raise --steps")
    g = cfg.rollout.samples_per_prompt
    before = window_rate(marks, args.warmup, args.scale_at, g)
    after = window_rate(marks, after_first, args.steps, g)
    cores = os.cpu_count()
    print(f"\nelastic scale-up on the real stack ({cores} cores; demo job, {cfg.learner.prompts_per_step} prompts x {g} "
          f"samples per step, train.max_staleness={cfg.train.max_staleness}); run folder {out}")
    print(f"{'':<44}{'before':>10}{'after':>10}{'ratio':>8}")
    print(f"{'rollout workers':<44}{args.workers:>10}{args.to:>10}")
    print(f"{'steps':<44}{f'{args.warmup}-{args.scale_at}':>10}{f'{after_first}-{args.steps}':>10}")
    print(f"{'samples generated per second':<44}{before:>10.1f}{after:>10.1f}{after / before:>8.2f}")
    wb, wa = wait_share(rows, args.warmup, args.scale_at), wait_share(rows, after_first, args.steps)
    print(f"{'learner wait share':<44}{wb:>10.3f}{wa:>10.3f}")
    print(f"\nrequest -> applied (step end + resize): {done['applied_at'] - done['requested_at']:.1f} s, of which the "
          f"resize {done['seconds']:.1f} s, with {done['steps_while_resizing']} steps trained meanwhile")
    for worker_id, seconds in firsts.items():
        print(f"request -> first sample of new worker id {worker_id}: {seconds:.1f} s")
    print(f"accuracy {summary['accuracy_before']:.2f} -> {summary['accuracy_after']:.2f}, "
          f"wall {summary['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
