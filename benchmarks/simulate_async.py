"""Asynchronous against synchronous RL at scale, in simulation (issue 4, benchmark 2): the real controller,
replay queue and staleness rules run with timed stand-ins for 64+ vLLM engines and the learner
(`cluster/simulator.py`). Prints throughput against the ideal bound min(generation, training capacity), the
learner's idle share and the speedup over the synchronous baseline of the same scenario, all from one run.

    python benchmarks/simulate_async.py [--engines 64] [--steps 40] [--warmup 8] [--seed 0]
"""

import argparse
import time

from cluster.simulator import SimulationResult, SimulatorConfig, balanced, simulate


def scenarios(base: SimulatorConfig) -> list[tuple[str, SimulatorConfig]]:
    """(name, config) rows; `base` is the balanced long-tailed headline."""
    rows = [("balanced long-tail (headline)", base), ("balanced long-tail, k=0 (synchronous)", base.synchronous())]
    rows += [(f"balanced long-tail, k={k}", base.model_copy(update={"max_staleness": k})) for k in (1, 2, 4, 8)]
    rows.append(("balanced long-tail, prompts_in_flight 8 (= max_num_seqs / G)",
                 base.model_copy(update={"prompts_in_flight": 8})))
    rows.append(("balanced long-tail, no partial rollouts", base.model_copy(update={"partial_rollouts": False})))
    rows.append(("generation-bound (learner 2x faster)", balanced(base, training_over_generation=2.0)))
    rows.append(("training-bound (learner 2x slower)", balanced(base, training_over_generation=0.5)))
    rows.append(("balanced long-tail, dynamic sampling",
                 balanced(base.model_copy(update={"drop_zero_variance": True}))))
    rows.append(("balanced short-tail (sigma 0.2, none at max)",
                 balanced(base.model_copy(update={"length_sigma": 0.2, "max_length_fraction": 0.0}))))
    rows.append(("synchronous, same pif (fair share caps it)", base.synchronous(even_split=False)))
    return rows


def fmt_drops(result: SimulationResult) -> str:
    # groups aborted when the run stops are an end-of-run artefact, not a loss of the steady state
    drops = {k: v for k, v in result.drops.items() if v and k != "aborted_at_stop"}
    return ", ".join(f"{k} {v}" for k, v in sorted(drops.items())) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = balanced(SimulatorConfig(num_engines=args.engines, prompts_per_step=8 * args.engines, steps=args.steps,
                                    warmup_steps=args.warmup, seed=args.seed))
    cap = base.model_dump()
    print(f"headline: {args.engines} engines x max_num_seqs {cap['max_num_seqs']}, prompts_in_flight "
          f"{cap['prompts_in_flight']}, {cap['prompts_per_step']} groups x {cap['samples_per_prompt']} samples "
          f"per step, k={cap['max_staleness']}; lengths lognormal(median {cap['median_response_tokens']}, sigma "
          f"{cap['length_sigma']}) with {cap['max_length_fraction']:.0%} at max {cap['max_response_tokens']}; "
          f"decode step {cap['decode_fixed_seconds']} + {cap['decode_seconds_per_seq']} * seqs s; weight load "
          f"{cap['sync_seconds']} s; learner {cap['learner_fixed_seconds']} + {cap['learner_seconds_per_token']:.3g}"
          f" * tokens s; steps {args.steps} (first {args.warmup} not measured)\n")
    header = ("| scenario | engines | k | partial | throughput tok/s | gen cap | train cap | ideal | of ideal | "
              "gen util | learner idle | x sync | max stale | drops (groups) | sim wall s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    sync_cache: dict[SimulatorConfig, SimulationResult] = {}
    for name, cfg in scenarios(base):
        start = time.perf_counter()
        result = simulate(cfg)
        wall = time.perf_counter() - start
        sync_cfg = cfg.synchronous()
        if sync_cfg not in sync_cache:
            sync_cache[sync_cfg] = result if sync_cfg == cfg else simulate(sync_cfg)
        sync = sync_cache[sync_cfg]
        c = result.capacities
        partial = "yes" if cfg.partial_rollouts and cfg.max_staleness else "no"
        print(f"| {name} | {cfg.num_engines} | {cfg.max_staleness} | {partial} "
              f"| {result.throughput:,.0f} | {c['generation_capacity']:,.0f} | {c['training_capacity']:,.0f} "
              f"| {c['ideal']:,.0f} | {result.fraction_of_ideal:.3f} "
              f"| {result.generated_tokens_per_s / c['decode_capacity']:.3f} | {result.learner_idle_frac:.3f} "
              f"| {result.throughput / sync.throughput:.2f} | {result.max_staleness_observed} | {fmt_drops(result)} "
              f"| {wall:.1f} |", flush=True)
    print("\nsynchronous baselines (k=0, no partial rollouts, prompts_in_flight = batch / engines):")
    for sync_cfg, sync in sync_cache.items():
        print(f"  learner {sync_cfg.learner_seconds_per_token:.3g} s/token, sigma {sync_cfg.length_sigma}, "
              f"dynamic sampling {sync_cfg.drop_zero_variance}: {sync.throughput:,.0f} tok/s = "
              f"{sync.fraction_of_ideal:.3f} of ideal, learner idle {sync.learner_idle_frac:.3f}")


if __name__ == "__main__":
    main()
