"""The elastic rollout pool in simulation (issue 32): a long chain-of-thought run whose responses grow 4x over
its 60 steps (simulator/elastic.py `growing_length_run`), with fixed pools of several sizes against the pool the
rollout autoscaler resizes (cluster/autoscaler.py's own decisions, rollout.autoscale's defaults, launched at 2
engines within 1..16). Prints, per pool, the learner's busy share and the trained tokens per second and per
engine-hour over the measured steps, then the issue's two goals: the autoscaled pool within 5% of the best fixed
pool's tokens per engine-hour, and the learner at least 90% busy.

The autoscaled row resizes as the driver does (cluster/scaling.py: decided between two steps, the new engines
starting and the leaving ones draining beside the learner); "learner waits for resizes" is the same decisions with
the learner waiting for each resize, for comparison.

    python benchmarks/elastic_pool.py [--fixed 2 3 4 5 6 8] [--seed 0]
"""

import argparse
import time

from protocols.autoscale import AutoscaleConfig
from simulator.elastic import growing_length_run
from simulator.simulation import SimulationResult, simulate


def row(name: str, result: SimulationResult, best_per_hour: float | None, wall: float) -> str:
    sizes = result.pool_sizes
    pool = f"{min(sizes)}..{max(sizes)}" if sizes else ""
    engines = result.engine_seconds / result.measured_seconds
    of_best = f"{result.tokens_per_engine_hour / best_per_hour:.3f}" if best_per_hour else ""
    drops = result.drops
    return (f"| {name} | {pool} | {engines:.2f} | {result.learner_busy_frac:.3f} | {result.throughput:,.0f} "
            f"| {result.tokens_per_engine_hour / 1e6:.3f} | {of_best} | {drops.get('stale', 0)} "
            f"| {drops.get('rollout_worker_drained', 0)} | {wall:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = growing_length_run(seed=args.seed)
    autoscale = AutoscaleConfig(enabled=True, min_workers=1, max_workers=16)
    print(f"growing-length run: {base.steps} steps ({base.warmup_steps} warmup), median response "
          f"{base.median_response_tokens} -> {base.median_response_tokens * (1 + base.length_growth):.0f} tokens, "
          f"max_staleness {base.max_staleness}; autoscaler: grow_wait_frac {autoscale.grow_wait_frac}, "
          f"shrink_wait_frac {autoscale.shrink_wait_frac}, shrink_queue_batches {autoscale.shrink_queue_batches}, "
          f"patience {autoscale.patience_steps}, cooldown {autoscale.cooldown_steps} steps\n")
    runs = []
    for n in args.fixed:
        start = time.perf_counter()
        runs.append((f"fixed {n}", simulate(base.model_copy(update={"num_engines": n})), time.perf_counter() - start))
    # the driver resizes beside the learner (cluster/scaling.py); the blocking row is how a driver that waited for
    # each resize would do, for comparison
    for name, blocks in (("autoscaled, learner waits for resizes", True), ("autoscaled", False)):
        start = time.perf_counter()
        cfg = base.model_copy(update={"autoscale": autoscale, "resize_blocks_learner": blocks})
        runs.append((name, simulate(cfg), time.perf_counter() - start))
    fixed = [(name, r) for name, r, _ in runs if name.startswith("fixed")]
    best = max(r.tokens_per_engine_hour for _, r in fixed)
    busy_fixed = [(name, r) for name, r in fixed if r.learner_busy_frac >= 0.9]
    header = ("| pool | sizes | engines (mean) | learner busy | tokens/s | M tokens / engine-hour | of best fixed "
              "| stale drops | drained drops | sim wall s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, result, wall in runs:
        print(row(name, result, best, wall))
    auto = runs[-1][1]
    print(f"\ngoal 1: autoscaled tokens per engine-hour {auto.tokens_per_engine_hour / best:.3f} of the best fixed "
          f"pool's (goal >= 0.95): {'met' if auto.tokens_per_engine_hour >= 0.95 * best else 'NOT met'}")
    print(f"goal 2: autoscaled learner busy {auto.learner_busy_frac:.3f} (goal >= 0.90): "
          f"{'met' if auto.learner_busy_frac >= 0.9 else 'NOT met'}")
    if busy_fixed:
        name, ref = max(busy_fixed, key=lambda nr: nr[1].tokens_per_engine_hour)
        print(f"against the best fixed pool that keeps the learner >= 90% busy ({name}): "
              f"{auto.tokens_per_engine_hour / ref.tokens_per_engine_hour:.3f} of its tokens per engine-hour")


if __name__ == "__main__":
    main()
