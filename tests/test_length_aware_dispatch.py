"""Length-aware dispatch (rollout.length_aware_dispatch): the controller's per-prompt length expectation sent with
each grant, the decode loop that hands its engine the longest-expected group whole when a slot frees, the
simulator's model of it, and the simulator's per-prompt length share."""

import statistics
from types import SimpleNamespace

from actors.controller import RolloutController
from actors.controller_messages import SyncRequest
from actors.decode_loop import DecodeLoop
from actors.length_history import LengthHistory
from protocols.group_header import GroupHeader
from protocols.config import RolloutConfig
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup
from simulator.dispatch import GroupDispatch
from simulator.scenario import prompt_lengths, response_length
from simulator.simulation import SimulatorConfig, balanced, simulate
from simulator.tools import ToolScenario
from tests.test_decode_loop import ScriptedEngine


def group_of(group_id: str, prompt: Prompt, lengths: list[int]) -> TrajectoryGroup:
    return TrajectoryGroup(group_id=group_id, trajectories=[
        Trajectory(group_id=group_id, sample_index=i, prompt=prompt, response_token_ids=[5] * n,
                   behavior_logprobs=[-0.5] * n, token_versions=[0] * n, finish_reason="stop", reward=float(i % 2))
        for i, n in enumerate(lengths)])


def test_length_history_prefers_the_hint_then_the_prompts_own_groups_then_the_mean_of_all():
    history = LengthHistory()
    a, b = Prompt(prompt_id="a", prompt_token_ids=[1]), Prompt(prompt_id="b", prompt_token_ids=[1])
    assert history.expected(a) == 0.0  # nothing seen yet
    history.record(GroupHeader.of(group_of("g0", a, [10, 30])))  # mean 20
    history.record(GroupHeader.of(group_of("g1", a, [40, 40])))  # newest weighted half: (20 + 40) / 2 = 30
    assert history.expected(a) == 30.0
    assert history.expected(b) == 30.0  # unseen: mean over the groups seen, (20 + 40) / 2
    hinted = Prompt(prompt_id="a", prompt_token_ids=[1], metadata={"length_hint": 500})
    assert history.expected(hinted) == 500.0


def test_controller_sends_each_granted_groups_expected_length_only_when_length_aware():
    prompt = Prompt(prompt_id="only", prompt_token_ids=[1])
    on = RolloutController([prompt], prompts_per_step=4, max_staleness=2, drop_zero_variance=False, seed=0,
                           length_aware=True)
    first = on.sync(SyncRequest(worker_id=0, version=0, want=2))
    assert first.expected_lengths == {"g0": 0.0, "g1": 0.0}
    # g0 comes back with lengths 6 and 2 (mean 4); the next grant of the same prompt expects 4 tokens
    second = on.sync(SyncRequest(worker_id=0, version=0, in_flight=1, want=1,
                                 scored=[("g0", group_of("g0", prompt, [6, 2]))]))
    assert second.expected_lengths == {"g2": 4.0}
    off = RolloutController([prompt], prompts_per_step=4, max_staleness=2, drop_zero_variance=False, seed=0)
    assert off.sync(SyncRequest(worker_id=0, version=0, want=2)).expected_lengths == {}


def test_decode_loop_hands_the_engine_the_longest_expected_group_whole_when_a_slot_frees():
    # 2 slots, groups of 2 samples, each sample's 2 tokens decode in one step. Groups a, b, c expected 10, 30, 20
    # tokens: step 1 hands over b (2 requests fill the slots), step 2 c, step 3 a.
    prompt = Prompt(prompt_id="p", prompt_token_ids=[7])
    scripts = {f"{g}/{i}": [1, 2] for g in "abc" for i in range(2)}
    engine = ScriptedEngine(scripts, per_step=2)
    loop = DecodeLoop(engine, lambda sample, n: SimpleNamespace(max_tokens=n), 2, 4, 0, max_num_seqs=2)
    for group_id, expected in (("a", 10.0), ("b", 30.0), ("c", 20.0)):
        loop.start_group(group_id, prompt, expected)
    assert engine.added == [] and loop.has_unfinished() and len(loop.active) == 3
    finished = [[g.group_id for g in loop.step(0)] for _ in range(3)]
    assert finished == [["b"], ["c"], ["a"]]
    assert [request_id for request_id, _, _ in engine.added] == ["b/0", "b/1", "c/0", "c/1", "a/0", "a/1"]
    assert not loop.has_unfinished()


def test_decode_loop_without_max_num_seqs_hands_every_group_over_at_once():
    scripts = {f"{g}/{i}": [1] for g in "ab" for i in range(2)}
    engine = ScriptedEngine(scripts)
    loop = DecodeLoop(engine, lambda sample, n: SimpleNamespace(max_tokens=n), 2, 4, 0)
    loop.start_group("a", Prompt(prompt_id="p", prompt_token_ids=[7]), 1.0)
    loop.start_group("b", Prompt(prompt_id="p", prompt_token_ids=[7]), 99.0)
    assert [request_id for request_id, _, _ in engine.added] == ["a/0", "a/1", "b/0", "b/1"]


def test_aborting_forgets_the_held_groups():
    engine = ScriptedEngine({"a/0": [1], "a/1": [1]})
    loop = DecodeLoop(engine, lambda sample, n: SimpleNamespace(max_tokens=n), 2, 4, 0, max_num_seqs=2)
    loop.start_group("a", Prompt(prompt_id="p", prompt_token_ids=[7]))
    assert loop.abort() == ["a"] and not loop.has_unfinished()


def test_simulated_group_dispatch_keeps_groups_whole_and_a_continuation_behind_at_most_one_group():
    seq = lambda name, priority: SimpleNamespace(name=name, priority=priority)  # noqa: E731
    waiting = GroupDispatch()
    waiting.extend([seq("a0", -10), seq("a1", -10)])
    waiting.extend([seq("b0", -30), seq("b1", -30)])
    waiting.extend([seq("c0", -20), seq("c1", -20)])
    # b (expected 30) goes first; after b0 starts, a continuation joins the engine's queue behind b1 only
    assert waiting.popleft().name == "b0"
    waiting.append(seq("t", 0))
    assert [waiting.popleft().name for _ in range(len(waiting))] == ["b1", "t", "c0", "c1", "a0", "a1"]


def test_prompt_share_one_gives_all_samples_of_a_prompt_one_length_and_keeps_the_share_at_max():
    import random

    cfg = SimulatorConfig(prompt_length_share=1.0, num_prompts=4000)
    prompts = prompt_lengths(cfg)
    rng = random.Random(0)
    assert len({response_length(rng, cfg, prompts[7]) for _ in range(5)}) == 1
    # the chance at max is 0 or 1 per prompt, 1 for about max_length_fraction = 5% of them
    assert {at_max for _, at_max in prompts} == {0.0, 1.0}
    assert abs(statistics.mean(at_max for _, at_max in prompts) - 0.05) < 0.01


def test_simulated_length_aware_dispatch_trains_faster_with_tool_calls():
    # 4 engines x 8 slots, prompts_in_flight 8 x 4 samples = 32 requests for 8 slots; 2 tool calls per sample of
    # 10 decode steps, k=2: with every group's requests in the engine's queue, a continuation waits behind up to 24
    # others; held at the worker, it waits behind at most one group (this seed: 966 against 885 tokens/s).
    cfg = balanced(SimulatorConfig(
        num_engines=4, max_num_seqs=8, prompts_in_flight=8, samples_per_prompt=4, prompts_per_step=16, steps=8,
        warmup_steps=3, decode_fixed_seconds=0.02, decode_seconds_per_seq=0.0025, sync_seconds=0.1,
        learner_fixed_seconds=0.1, median_response_tokens=40, length_sigma=0.3, max_length_fraction=0.0,
        max_response_tokens=200, token_chunk=1, num_prompts=256, max_staleness=2,
        tools=ToolScenario(calls_per_sample=2, calls_distribution="fixed", output_tokens=8, seconds_per_call=0.4)))
    off, on = simulate(cfg), simulate(cfg.model_copy(update={"length_aware": True}))
    assert on.throughput > 1.05 * off.throughput


def test_length_aware_dispatch_is_off_by_default_and_a_command_line_switch():
    assert RolloutConfig().length_aware_dispatch is False
    assert RolloutConfig(length_aware_dispatch=True).length_aware_dispatch is True


def test_simulated_hold_in_arrival_order_trains_exactly_what_the_engine_queue_does():
    # single-turn: holding groups at the worker and handing them over in arrival order starts every sample at the
    # same step as the engine's first-come-first-served queue, so the runs are identical
    cfg = SimulatorConfig(num_engines=4, max_num_seqs=8, prompts_in_flight=8, samples_per_prompt=4,
                          prompts_per_step=16, steps=6, warmup_steps=2, median_response_tokens=40,
                          max_response_tokens=200, token_chunk=8, num_prompts=64, max_staleness=2)
    off = simulate(cfg)
    held = simulate(cfg.model_copy(update={"length_aware": True, "length_dispatch": "hold"}))
    assert held.trained_group_ids == off.trained_group_ids and held.throughput == off.throughput
