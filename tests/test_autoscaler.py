"""cluster/autoscaler.py: the rollout autoscaler's decisions on hand-made step numbers."""

import pytest

from cluster.autoscaler import Autoscaler, StepSignals
from protocols.config import ConfigError, load_config


def _cfg(**fields):
    overrides = ["rollout.autoscale.enabled=true", *(f"rollout.autoscale.{k}={v}" for k, v in fields.items())]
    return load_config(None, overrides).rollout.autoscale


def waiting(frac: float, depth: int = 0, stale: int = 0) -> StepSignals:
    # a 1 s step of which `frac` waited for data; 4 prompts per step
    return StepSignals(wait_s=frac, step_s=1.0, queue_depth=depth, prompts_per_step=4, dropped_stale=stale)


def test_grows_after_patience_steps_of_waiting_then_holds_through_the_cooldown():
    scaler = Autoscaler(_cfg(patience_steps=2, cooldown_steps=2, max_workers=3))
    # wait 0.5 > grow_wait_frac 0.3: the first step is patience, the second grows 1 -> 2
    assert scaler.decide(1, waiting(0.5)) == (1, "hold")
    assert scaler.decide(1, waiting(0.5)) == (2, "grow_waiting")
    # two cooldown steps change nothing, but they measure the new size: both waited, so the step after grows
    assert scaler.decide(2, waiting(0.9)) == (2, "hold_cooldown")
    assert scaler.decide(2, waiting(0.9)) == (2, "hold_cooldown")
    assert scaler.decide(2, waiting(0.9)) == (3, "grow_waiting")


def test_never_grows_past_max_nor_shrinks_below_min():
    scaler = Autoscaler(_cfg(patience_steps=1, cooldown_steps=0, min_workers=2, max_workers=2))
    assert scaler.decide(2, waiting(0.9)) == (2, "hold")
    assert scaler.decide(2, waiting(0.0, depth=8)) == (2, "hold")


def test_a_signal_that_breaks_its_streak_starts_patience_again():
    scaler = Autoscaler(_cfg(patience_steps=2, cooldown_steps=0))
    assert scaler.decide(1, waiting(0.5))[0] == 1
    assert scaler.decide(1, waiting(0.1))[0] == 1  # 0.1 is between the thresholds: neither streak goes on
    assert scaler.decide(1, waiting(0.5))[0] == 1
    assert scaler.decide(1, waiting(0.5))[0] == 2


def test_shrinks_when_the_learner_does_not_wait_and_the_queue_is_full_or_drops_stale_groups():
    scaler = Autoscaler(_cfg(patience_steps=2, cooldown_steps=0))
    # wait 0.01 < shrink_wait_frac 0.02 and shrink_queue_batches=2 whole batches (8 groups) queued: two such steps
    # shrink 3 -> 2
    assert scaler.decide(3, waiting(0.01, depth=8)) == (3, "hold")
    assert scaler.decide(3, waiting(0.01, depth=8)) == (2, "shrink_queue_full")
    # not waiting but one batch queued (as a pool of the right size shows) and nothing dropped: no reason to shrink
    assert scaler.decide(2, waiting(0.01, depth=4)) == (2, "hold")
    assert scaler.decide(2, waiting(0.01, depth=7)) == (2, "hold")
    # stale drops growing (the running total 0 -> 3 -> 5) count as generation ahead of the learner
    assert scaler.decide(2, waiting(0.01, depth=1, stale=3)) == (2, "hold")
    assert scaler.decide(2, waiting(0.01, depth=1, stale=5)) == (1, "shrink_stale_drops")


def test_thresholds_that_overlap_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="shrink_wait_frac=0.4 must be below grow_wait_frac=0.3"):
        _cfg(shrink_wait_frac=0.4, grow_wait_frac=0.3)
    with pytest.raises(ConfigError, match="min_workers=3 is above max_workers=2: set min_workers <= max_workers"):
        _cfg(min_workers=3, max_workers=2)
