"""Controller load at scale, in simulation (issue 8, item 4): calls the rollout workers make to the one
controller actor, per simulated second and per finished group, at 64, 256 and 1,024 engines, for the old loop
(`legacy`: a poll and an acquire per decode step, a put per group) against the batched one (`sync` per batch of
groups plus a long poll for news), both driven by the workers' own `WorkerPolicy` (`simulator/simulation.py`).

    python benchmarks/control_plane.py [--engines 64 256 1024] [--steps 8] [--warmup 3]

`extra/(versions x workers)` is (calls - finished groups) / (published versions x workers): the calls beyond one
per finished group, per weight version and worker; the goal is that it stays a small constant as engines grow.
"""

import argparse
import time

from simulator.simulation import SimulationResult, SimulatorConfig, balanced, simulate


def headline(engines: int, steps: int, warmup: int) -> SimulatorConfig:
    """The balanced long-tailed scenario of benchmarks/simulate_async.py, at `engines` engines."""
    return balanced(SimulatorConfig(num_engines=engines, prompts_per_step=8 * engines, steps=steps,
                                    warmup_steps=warmup))


def row(name: str, cfg: SimulatorConfig) -> tuple[str, SimulatorConfig, SimulationResult, float]:
    start = time.perf_counter()
    result = simulate(cfg)
    return name, cfg, result, time.perf_counter() - start


def fmt(name: str, cfg: SimulatorConfig, r: SimulationResult, wall: float, base: SimulationResult | None) -> str:
    calls = sum(r.controller_calls.values())
    extra = (calls - r.finished_groups) / (cfg.steps * cfg.num_engines)
    methods = ", ".join(f"{k} {v:,}" for k, v in sorted(r.controller_calls.items(), key=lambda kv: -kv[1]))
    ratio = f"{sum(base.controller_calls.values()) / calls:,.0f}x fewer" if base else "-"
    return (f"| {name} | {cfg.num_engines} | {cfg.control} | {calls / r.sim_seconds:,.1f} "
            f"| {calls / r.finished_groups:.3f} | {extra:.2f} | {ratio} | {r.throughput:,.0f} "
            f"| {r.finished_groups:,} | {methods} | {wall:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    small = headline(args.engines[0], args.steps, args.warmup)
    print(f"headline scenario (benchmarks/simulate_async.py) with {args.steps} learner steps: prompts_per_step = "
          f"8 x engines, prompts_in_flight {small.prompts_in_flight}, max_num_seqs {small.max_num_seqs}, "
          f"k={small.max_staleness}; batched: min_groups_per_request {small.min_groups_per_request}, "
          f"poll_interval_s {small.poll_interval_s} (simulated seconds)\n")
    header = ("| scenario | engines | control | calls/s | calls per finished group | extra/(versions x workers) "
              "| vs legacy | throughput tok/s | finished groups | calls by method | sim wall s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    scenarios = [(f"headline, {n} engines", headline(n, args.steps, args.warmup)) for n in args.engines]
    scenarios += [(f"k=0 synchronous, {small.num_engines} engines", small.synchronous()),
                  (f"k=1, {small.num_engines} engines", small.model_copy(update={"max_staleness": 1})),
                  (f"dynamic sampling, {small.num_engines} engines",
                   balanced(small.model_copy(update={"drop_zero_variance": True})))]
    for name, cfg in scenarios:
        legacy = row(name, cfg.model_copy(update={"control": "legacy"}))
        print(fmt(*legacy, None), flush=True)
        batched = row(name, cfg)
        print(fmt(*batched, legacy[2]), flush=True)


if __name__ == "__main__":
    main()
