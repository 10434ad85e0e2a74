"""The scale simulator drives the real controller and replay queue with 64 simulated engines: accounting,
staleness bounds and version order hold, and asynchronous beats synchronous on long-tailed lengths."""

import pytest

from simulator.simulation import SimulatorConfig, _stamp, balanced, simulate


def small(**update) -> SimulatorConfig:
    # 64 engines x 8 sequences, 64 groups x 4 samples per step; lengths median 40, 5% run to 200 tokens.
    # token_chunk 1 stores every token's version, so the checks below see exactly what the queue saw.
    cfg = SimulatorConfig(num_engines=64, max_num_seqs=8, prompts_in_flight=4, samples_per_prompt=4,
                          prompts_per_step=64, steps=10, warmup_steps=3, decode_fixed_seconds=0.02,
                          decode_seconds_per_seq=0.0025, sync_seconds=0.1, learner_fixed_seconds=0.1,
                          median_response_tokens=40, max_response_tokens=200, token_chunk=1, num_prompts=256)
    return balanced(cfg.model_copy(update=update))


@pytest.mark.parametrize("k, dynamic", [(0, True), (2, True), (1, False)])
def test_every_admitted_group_is_trained_once_or_dropped_with_a_counted_reason(k, dynamic):
    result = simulate(small(max_staleness=k, drop_zero_variance=dynamic))
    trained = result.trained_group_ids
    assert len(trained) == len(set(trained)) == 10 * 64  # none twice; 10 steps of 64 groups
    fates = [set(trained), set(result.waiting_group_ids), *map(set, result.dropped_group_ids.values())]
    assert sum(len(f) for f in fates) == len(set().union(*fates))  # no group has two fates
    assert set().union(*fates) == {f"g{i}" for i in range(result.admitted)}  # none lost
    for reason, ids in result.dropped_group_ids.items():
        assert result.drops.get(reason, 0) == len(ids), reason
    if dynamic:
        assert result.drops["zero_variance"] > 0  # uniform success rates: about 2/(G+1) = 40% of groups


def test_synchronous_mode_trains_only_on_tokens_of_the_learner_version():
    result = simulate(small(max_staleness=0))
    assert result.max_staleness_observed == 0 and result.min_lag_observed == 0
    assert result.drops.get("stale", 0) == 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_no_trained_sample_is_older_than_max_staleness(k):
    result = simulate(small(max_staleness=k))
    assert 1 <= result.max_staleness_observed <= k  # asynchronous, and within the bound


def test_each_engine_sees_only_increasing_versions():
    result = simulate(small(max_staleness=2))
    for seen in result.versions_seen:
        assert seen[0] == 0 and all(a < b for a, b in zip(seen, seen[1:]))
    # versions 1..9 reach the engines; 10 comes with the stop flag, and a worker leaves without loading it (as
    # RolloutWorker.run does: the trainer loads the final weights afterwards for evaluation)
    assert max(max(seen) for seen in result.versions_seen) == 9


def test_async_throughput_beats_sync_on_balanced_long_tails():
    cfg = small(max_staleness=2)
    asynchronous, synchronous = simulate(cfg), simulate(cfg.synchronous())
    assert asynchronous.throughput > 1.5 * synchronous.throughput
    assert asynchronous.learner_idle_frac < synchronous.learner_idle_frac


def test_same_seed_gives_the_same_run():
    a, b = simulate(small(max_staleness=1)), simulate(small(max_staleness=1))
    assert a.throughput == b.throughput and a.trained_group_ids == b.trained_group_ids


def test_tokens_carry_the_version_in_force_when_sampled():
    # version 1 from step 5, version 2 from step 9; a response of 6 tokens started at step 3 is sampled in
    # steps 3..8: versions [0, 0, 1, 1, 1, 1]; chunks of 4 carry their first token's version: [0, 1]
    changes = [(0, 0), (5, 1), (9, 2)]
    assert _stamp(3, 6, changes, 1) == [0, 0, 1, 1, 1, 1]
    assert _stamp(3, 6, changes, 4) == [0, 1]
    assert _stamp(9, 3, changes, 1) == [2, 2, 2]


def test_balanced_learner_matches_generation_capacity():
    from simulator.simulation import capacities

    cap = capacities(small())
    assert cap["training_capacity"] == pytest.approx(cap["generation_capacity"])
    # 64 engines x 8 sequences / (0.02 + 0.0025 * 8) s per step = 12,800 tokens/s
    assert cap["decode_capacity"] == pytest.approx(12_800)


def test_warmup_must_leave_measured_steps():
    with pytest.raises(ValueError, match="warmup_steps=5 leaves no measured step of steps=5"):
        SimulatorConfig(steps=5, warmup_steps=5)


def test_synchronous_fair_share_caps_workers_that_ask_for_more():
    # k=0, 64 groups per step over 64 engines: the controller's fair share is ceil(64 / 64) = 1 group in flight,
    # so prompts_in_flight 4 runs exactly as the even split prompts_in_flight 1 (the workers pass their in-flight
    # count through the same WorkerPolicy the simulator drives)
    greedy = simulate(small(max_staleness=0, partial_rollouts=False))
    even = simulate(small().synchronous())
    assert greedy.trained_group_ids == even.trained_group_ids and greedy.throughput == even.throughput
