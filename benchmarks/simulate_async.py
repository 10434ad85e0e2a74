"""Asynchronous against synchronous RL at scale, in simulation (issue 4, benchmark 2): the real controller,
replay queue and staleness rules run with timed stand-ins for 64+ vLLM engines and the learner
(`simulator/simulation.py`). Prints throughput against the ideal bound min(generation, training capacity), the
learner's idle share and the speedup over the synchronous baseline of the same scenario, all from one run.
`--multi-turn` runs the tool-using rows instead (`simulator/tools.py`): tool calls of 0 to 1000 decode steps,
each against the ideal bound, the same run with tools that answer at once, and its synchronous baseline.
`--length-aware` runs each long-tail row with length-aware dispatch off and on, same seed (rollout.
length_aware_dispatch; simulator/dispatch.py, actors/length_history.py).

    python benchmarks/simulate_async.py [--engines 64] [--steps 40] [--warmup 8] [--seed 0] [--multi-turn]
                                        [--length-aware]
"""

import argparse
import time

from simulator.simulation import SimulationResult, SimulatorConfig, balanced, simulate
from simulator.tools import ToolScenario, decode_step_seconds


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


def multi_turn_scenarios(base: SimulatorConfig) -> list[tuple[str, float, SimulatorConfig]]:
    """(name, tool seconds in decode steps, config) rows: `base` with Poisson(4) tool calls per sample of 64 output
    tokens each, exponential tool seconds, the learner balanced against generation in response tokens."""
    step = decode_step_seconds(base)

    def with_tools(steps: float, **tools) -> SimulatorConfig:
        return balanced(base.model_copy(update={"tools": ToolScenario(seconds_per_call=steps * step, **tools)}))

    rows = [(f"tool call {m:g} decode steps", m, with_tools(m)) for m in (0, 1, 10, 100, 1000)]
    rows.append(("tool call 10 decode steps, continuations first", 10, with_tools(10, continue_first=True)))
    rows.append(("tool call 1000 decode steps, continuations first", 1000, with_tools(1000, continue_first=True)))
    rows.append(("tool call 10 decode steps, pool of 4 per worker", 10, with_tools(10, pool_size=4)))
    return rows


def run_multi_turn(base: SimulatorConfig) -> None:
    """The multi-turn table. `of ideal`: trained response tokens/s (sampled + tool tokens) over min(generation
    capacity with every engine slot decoding at every step, training capacity); `of no-latency`: over the same
    scenario whose tools answer at once (same turns, tokens and queue policy)."""
    print(f"multi-turn: Poisson(4) tool calls per sample (at most 7: max_turns 8), 64 tool tokens each, exponential "
          f"tool seconds; a decode step of a full engine is {decode_step_seconds(base):.3f} s\n")
    header = ("| scenario | tool s | k | throughput tok/s | ideal | of ideal | of no-latency | gen util "
              "| sync of ideal | x sync | stale drops | sim wall s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    no_latency: dict[bool, SimulationResult] = {}
    for name, steps, cfg in multi_turn_scenarios(base):
        start = time.perf_counter()
        result, sync = simulate(cfg), simulate(cfg.synchronous())
        wall = time.perf_counter() - start
        first = cfg.tools.continue_first
        if steps == 0:
            no_latency[first] = result
        if first not in no_latency:
            no_latency[first] = simulate(cfg.model_copy(update={"tools": cfg.tools.model_copy(
                update={"seconds_per_call": 0.0})}))
        c = result.capacities
        print(f"| {name} | {cfg.tools.seconds_per_call:.3g} | {cfg.max_staleness} | {result.throughput:,.0f} "
              f"| {c['ideal']:,.0f} | {result.fraction_of_ideal:.3f} "
              f"| {result.throughput / no_latency[first].throughput:.3f} "
              f"| {result.generated_tokens_per_s / c['decode_capacity']:.3f} "
              f"| {sync.fraction_of_ideal:.3f} | {result.throughput / sync.throughput:.2f} "
              f"| {result.drops.get('stale', 0)} | {wall:.1f} |", flush=True)


def length_aware_scenarios(base: SimulatorConfig) -> list[tuple[str, SimulatorConfig]]:
    """(name, config with length-aware dispatch off) rows. The prompt set is 8 batches, so a prompt comes back
    every 8 steps and the controller's history has its earlier lengths from the second pass on."""
    base = base.model_copy(update={"num_prompts": 8 * base.prompts_per_step})
    prompt_set = balanced(base.model_copy(update={"prompt_length_share": 0.8}))
    step = decode_step_seconds(base)
    return [
        ("balanced long-tail (headline): lengths independent of the prompt", balanced(base)),
        ("lengths 80% the prompt's (as in the long-CoT demo)", prompt_set),
        ("lengths 80% the prompt's, length hints in the data", prompt_set.model_copy(update={"length_hints": True})),
        ("lengths 80% the prompt's, k=4 (below the rule)", prompt_set.model_copy(update={"max_staleness": 4})),
        ("tool calls of 10 decode steps (lengths independent)",
         balanced(base.model_copy(update={"tools": ToolScenario(seconds_per_call=10 * step)}))),
    ]


def run_length_aware(base: SimulatorConfig) -> None:
    """Each row off and on with the same seed: `length-aware` holds the granted groups at the worker and hands the
    engine the longest-expected whole group when its queue is empty; `engine priority (study)` gives every request
    its group's priority in vLLM's own queue instead; `held, arrival order (study)` holds the groups but hands them
    over in arrival order."""
    header = ("| scenario | k | dispatch | throughput tok/s | of ideal | learner idle | max stale | stale drops "
              "(groups) | x off | sim wall s |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name, cfg in length_aware_scenarios(base):
        variants = [("off", cfg), ("length-aware", cfg.model_copy(update={"length_aware": True}))]
        if cfg.tools is None and cfg.prompt_length_share and not cfg.length_hints and cfg.max_staleness == 5:
            variants.append(("engine priority (study)", cfg.model_copy(
                update={"length_aware": True, "length_dispatch": "engine"})))
        if cfg.tools is not None or cfg.max_staleness < 5:
            variants.append(("held, arrival order (study)", cfg.model_copy(
                update={"length_aware": True, "length_dispatch": "hold"})))
        off = None
        for dispatch, variant in variants:
            start = time.perf_counter()
            result = simulate(variant)
            off = off or result
            print(f"| {name} | {variant.max_staleness} | {dispatch} | {result.throughput:,.0f} "
                  f"| {result.fraction_of_ideal:.3f} | {result.learner_idle_frac:.3f} "
                  f"| {result.max_staleness_observed} | {result.drops.get('stale', 0)} "
                  f"| {result.throughput / off.throughput:.3f} | {time.perf_counter() - start:.1f} |", flush=True)


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
    parser.add_argument("--multi-turn", action="store_true", help="tool-using rows (simulator/tools.py)")
    parser.add_argument("--length-aware", action="store_true", help="length-aware dispatch off and on, same seed")
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
    if args.multi_turn:
        run_multi_turn(base)
        return
    if args.length_aware:
        run_length_aware(base)
        return
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
