"""Multi-turn samples in the scale simulator: a sample at a tool call gives up its engine slot while the tool runs,
tool tokens are context in the response (never decoded, never trained), and asynchronous rollouts keep the
engines full through tool calls of 10 decode steps while the synchronous baseline does not."""

import random

from simulator.simulation import Simulation, SimulatorConfig, balanced, capacities, simulate
from simulator.tools import ToolScenario, decode_step_seconds, plan_sample


def tiny(**tools) -> SimulatorConfig:
    # 8 engines x 8 sequences, 32 groups x 4 samples per step, prompts_in_flight 8 (32 samples for 8 slots),
    # 8 steps (the first 3 not measured);
    # lengths median 40 (sigma 0.3, none at the 200-token limit); 2 tool calls per sample of 8 output tokens;
    # a full engine's decode step is 0.02 + 0.0025 * 8 = 0.04 s; k=4; the learner balanced against generation.
    cfg = SimulatorConfig(num_engines=8, max_num_seqs=8, prompts_in_flight=8, samples_per_prompt=4,
                          prompts_per_step=32, steps=8, warmup_steps=3, decode_fixed_seconds=0.02,
                          decode_seconds_per_seq=0.0025, sync_seconds=0.1, learner_fixed_seconds=0.1,
                          median_response_tokens=40, length_sigma=0.3, max_length_fraction=0.0,
                          max_response_tokens=200, token_chunk=1, num_prompts=256, max_staleness=4,
                          tools=ToolScenario(**{"calls_per_sample": 2, "calls_distribution": "fixed",
                                                "output_tokens": 8, **tools}))
    return balanced(cfg)


def trained_trajectories(cfg: SimulatorConfig) -> list:
    """Run `cfg` and return every trajectory the learner took."""
    sim = Simulation(cfg)
    taken, take_batch = [], sim.controller.take_batch

    def capture(version):
        batch = take_batch(version)
        taken.extend(batch or [])
        return batch

    sim.controller.take_batch = capture
    sim.run()
    return [t for group in taken for t in group.inline().trajectories]


def test_async_multi_turn_keeps_09_of_ideal_with_tool_calls_of_10_decode_steps():
    cfg = tiny(seconds_per_call=10 * 0.04)
    assert decode_step_seconds(cfg) == 0.04
    asynchronous, synchronous = simulate(cfg), simulate(cfg.synchronous())
    assert asynchronous.tool_calls > 0
    # ideal: response tokens/s with every engine slot decoding at every step (or the learner's capacity)
    assert asynchronous.fraction_of_ideal >= 0.9
    assert synchronous.fraction_of_ideal < 0.5 * asynchronous.fraction_of_ideal


def test_a_sample_in_a_tool_call_gives_up_its_engine_slot():
    # tool calls of 100 decode steps: samples in a call plus sequences decoding exceed the engine's 8 slots,
    # which only happens if a sample in a call holds no slot; the engines keep decoding meanwhile
    sim = Simulation(tiny(seconds_per_call=100 * 0.04))
    result = sim.run()
    assert max(e.peak_held for e in sim.engines) > 8
    assert result.generated_tokens_per_s > 0.25 * result.capacities["decode_capacity"]


def test_tool_tokens_are_context_in_the_response_and_never_decoded():
    trajectories = trained_trajectories(tiny(seconds_per_call=0.4, seconds_distribution="fixed"))
    assert len(trajectories) == 8 * 32 * 4
    for t in trajectories:
        assert [(c.output_tokens, c.seconds) for c in t.tool_calls] == [(8, 0.4), (8, 0.4)]
        tool = [i for i, m in enumerate(t.loss_mask) if not m]
        assert len(tool) == 16 and all(t.token_versions[i] == -1 and t.behavior_logprobs[i] == 0.0 for i in tool)
        assert t.min_version >= 0 and t.num_turns == 3
    cap = capacities(tiny())
    # 2 calls x 8 tokens per sample in the response, none of them sampled
    assert abs(cap["mean_length"] - cap["mean_generated"] - 16) < 1e-9


def test_plan_splits_the_budget_across_turns_and_tool_outputs():
    fixed = ToolScenario(calls_per_sample=2, calls_distribution="fixed", output_tokens=8, seconds_per_call=0.5,
                         seconds_distribution="fixed")
    plan = plan_sample(random.Random(0), fixed, 40, 200)
    # 40 sampled tokens in 3 turns of at least one each, two outputs of 8: a 56-token response
    assert len(plan.turns) == 3 and min(plan.turns) >= 1 and plan.generated == 40 and plan.response == 56
    assert plan.tool_seconds == [0.5, 0.5] and plan.finish_reason == "stop"
    # budget 45: the 16 tool tokens leave 29 sampled tokens of the 40, so the response is cut at 45
    cut = plan_sample(random.Random(0), fixed, 40, 45)
    assert cut.response == 45 and cut.finish_reason == "length"
    # five calls wanted, max_turns 3: two calls, and the sample ends on its third turn, truncated
    capped = plan_sample(random.Random(0), fixed.model_copy(update={"calls_per_sample": 5, "max_turns": 3}), 40, 200)
    assert len(capped.tool_seconds) == 2 and capped.finish_reason == "max_turns"


def test_tool_seconds_distributions_keep_their_mean():
    rng = random.Random(0)
    for dist in ("exponential", "lognormal"):
        tools = ToolScenario(calls_per_sample=20, seconds_per_call=2.0, seconds_distribution=dist)
        seconds = [s for _ in range(2000) for s in plan_sample(rng, tools, 10_000, 100_000).tool_seconds]
        assert abs(sum(seconds) / len(seconds) - 2.0) < 0.1, dist  # 40,000 draws: standard error about 0.01-0.02


def test_same_seed_gives_the_same_multi_turn_run():
    a, b = simulate(tiny(seconds_per_call=0.4)), simulate(tiny(seconds_per_call=0.4))
    assert a.throughput == b.throughput and a.trained_group_ids == b.trained_group_ids and a.tool_calls == b.tool_calls


def test_a_tool_pool_of_one_serializes_calls():
    # one call at a time per worker with 32 samples in flight: calls queue for the pool and generation slows
    free = simulate(tiny(seconds_per_call=0.4))
    pool = simulate(tiny(seconds_per_call=0.4, pool_size=1))
    assert pool.generated_tokens_per_s < free.generated_tokens_per_s
