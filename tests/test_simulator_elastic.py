"""The elastic pool in simulation (simulator/elastic.py): responses that grow over the run, and the rollout
autoscaler's own decisions resizing the pool of engine stand-ins; accounting, staleness and engine-hours hold
while engines come and go."""

import pytest

from protocols.autoscale import AutoscaleConfig
from simulator.elastic import ElasticSimulation, growing_length_run
from simulator.simulation import Simulation, SimulatorConfig, simulate
from tests.test_simulator import small


def elastic(drain_timeout_s: float = 120.0, blocks: bool = True, **update):
    # the small 64-engine scenario at k=2, lengths growing 4x over 30 steps, launched at 16 engines within 4..32;
    # patience 1 and cooldown 1 so that the pool moves both ways within the run (16 -> 19 -> 11 or so)
    autoscale = AutoscaleConfig(enabled=True, min_workers=4, max_workers=32, patience_steps=1, cooldown_steps=1)
    return small(max_staleness=2, length_growth=3.0, steps=30, warmup_steps=3, num_engines=16,
                 engine_start_seconds=0.5, drain_timeout_s=drain_timeout_s, resize_blocks_learner=blocks,
                 autoscale=autoscale, **update)


def test_responses_grow_with_the_policy_version_that_samples_them():
    # length_growth 3: a group sampled at version v of 30 is 1 + 3 v / 30 times longer, so the trained tokens of the
    # last steps (versions about 25-29: x 3.5 to 3.9) are well above 3x those of the first (version 0-2: x 1 to 1.2)
    sim = Simulation(small(max_staleness=2, length_growth=3.0, steps=30, warmup_steps=3))
    sim.run()
    first, last = sum(sim.step_tokens[:3]), sum(sim.step_tokens[-3:])
    assert last > 2.5 * first
    flat = Simulation(small(max_staleness=2, steps=30, warmup_steps=3))
    flat.run()
    assert sum(flat.step_tokens[-3:]) < 1.5 * sum(flat.step_tokens[:3])  # no growth: about the same


@pytest.mark.parametrize("drain_timeout_s, blocks", [(120.0, True), (0.5, True), (0.5, False)])
def test_every_admitted_group_is_trained_once_or_dropped_with_a_reason_while_the_pool_resizes(drain_timeout_s, blocks):
    result = simulate(elastic(drain_timeout_s, blocks))
    sizes = result.pool_sizes
    assert max(sizes) > 16 and any(b < a for a, b in zip(sizes, sizes[1:]))  # it grew and it shrank
    assert all(4 <= s <= 32 for s in sizes)
    trained = result.trained_group_ids
    assert len(trained) == len(set(trained)) == 30 * 64
    fates = [set(trained), set(result.waiting_group_ids), *map(set, result.dropped_group_ids.values())]
    assert sum(len(f) for f in fates) == len(set().union(*fates))  # no group has two fates
    assert set().union(*fates) == {f"g{i}" for i in range(result.admitted)}  # none lost
    for reason, ids in result.dropped_group_ids.items():
        assert result.drops.get(reason, 0) == len(ids), reason
    if drain_timeout_s < 1:  # a 0.5 s drain cannot finish a group: what leaving engines held is released, counted
        assert result.drops["rollout_worker_drained"] > 0
    else:
        assert result.drops.get("rollout_worker_drained", 0) == 0
    assert 1 <= result.max_staleness_observed <= 2


def test_the_decisions_are_the_autoscalers_one_per_step_and_engine_hours_follow_the_pool():
    result = simulate(elastic())
    # one decision after each step but the last: 29 (the reasons of cluster/autoscaler.py)
    assert sum(result.autoscale_reasons.values()) == 29 == len(result.pool_sizes)
    assert set(result.autoscale_reasons) <= {"hold", "hold_cooldown", "grow_waiting", "shrink_queue_full",
                                             "shrink_stale_drops"}
    # engine-seconds lie between the smallest and the largest pool held over the measured window
    engines = result.engine_seconds / result.measured_seconds
    assert min(result.pool_sizes) - 1 <= engines <= max(result.pool_sizes)
    fixed = simulate(small(max_staleness=2, steps=30, warmup_steps=3, num_engines=16))
    assert fixed.engine_seconds == pytest.approx(16 * fixed.measured_seconds)  # a fixed pool: 16 throughout
    # tokens per engine-hour: trained tokens over engine-seconds, x 3600
    assert fixed.tokens_per_engine_hour == pytest.approx(fixed.throughput * 3600 / 16)


def test_an_autoscaled_pool_must_launch_within_its_limits():
    with pytest.raises(ValueError, match=r"num_engines=2 is the autoscaled pool's launch size: it must lie in "
                                         r"autoscale.min_workers=4..max_workers=32"):
        SimulatorConfig(**{**small().model_dump(), "num_engines": 2,
                           "autoscale": AutoscaleConfig(enabled=True, min_workers=4, max_workers=32)})


def test_the_growing_length_run_uses_the_elastic_simulation_only_when_autoscaled():
    cfg = growing_length_run(steps=8, warmup_steps=2)
    assert cfg.length_growth == 3.0 and cfg.autoscale is None
    assert isinstance(ElasticSimulation(cfg.model_copy(update={"autoscale": AutoscaleConfig(enabled=True)})),
                      Simulation)
