"""The rollout autoscaler (`rollout.autoscale`, off by default): after each step it reads what the step measured
and asks the rollout pool for one worker more or one fewer. Pure: the driver feeds it numbers and applies its
answer through the same `Trainer.scale` as `relayrl scale`.

- Grow while the learner waits for data: the share of the step spent waiting (`time/wait_s / time/step_s`) stays
  above `grow_wait_frac`.
- Shrink while generation is ahead: the learner hardly waits (below `shrink_wait_frac`) and either the queue holds
  `shrink_queue_batches` whole batches or groups are being dropped as too stale (their tokens were generated for
  nothing).
- Hysteresis: a signal must hold for `patience_steps` steps in a row; after any change the autoscaler waits
  `cooldown_steps` steps, so the new size is measured before it moves again (the cooldown's steps count toward
  the next streak: they measured the new size).
"""

from dataclasses import dataclass

from protocols.autoscale import AutoscaleConfig


@dataclass(frozen=True)
class StepSignals:
    """What one step measured, as the driver logs it."""

    wait_s: float
    step_s: float
    queue_depth: int
    """Groups queued after the step (the controller's queue/depth)."""
    prompts_per_step: int
    dropped_stale: int
    """Groups dropped as too stale so far (queue/dropped_stale), a running total."""


class Autoscaler:
    """`decide` once per step: the size the pool should have now, and why (a metrics name's suffix)."""

    def __init__(self, cfg: AutoscaleConfig) -> None:
        self.cfg = cfg
        self.grow_streak = 0
        self.shrink_streak = 0
        self.cooldown = 0
        self.last_dropped_stale = 0

    def decide(self, size: int, signals: StepSignals) -> tuple[int, str]:
        """(new size, reason): `grow_waiting`, `shrink_queue_full`, `shrink_stale_drops`, or `hold_*`."""
        cfg = self.cfg
        wait_frac = signals.wait_s / signals.step_s if signals.step_s > 0 else 0.0
        stale_grew = signals.dropped_stale > self.last_dropped_stale
        self.last_dropped_stale = signals.dropped_stale
        ahead = signals.queue_depth >= cfg.shrink_queue_batches * signals.prompts_per_step
        self.grow_streak = self.grow_streak + 1 if wait_frac > cfg.grow_wait_frac else 0
        self.shrink_streak = (self.shrink_streak + 1 if wait_frac < cfg.shrink_wait_frac and (ahead or stale_grew)
                              else 0)
        if self.cooldown > 0:
            self.cooldown -= 1
            return size, "hold_cooldown"
        if self.grow_streak >= cfg.patience_steps and size < cfg.max_workers:
            return self._change(size + 1), "grow_waiting"
        if self.shrink_streak >= cfg.patience_steps and size > cfg.min_workers:
            return self._change(size - 1), "shrink_stale_drops" if stale_grew else "shrink_queue_full"
        if size < cfg.min_workers:
            return self._change(cfg.min_workers), "grow_below_min"
        if size > cfg.max_workers:
            return self._change(cfg.max_workers), "shrink_above_max"
        return size, "hold"

    def _change(self, size: int) -> int:
        self.grow_streak = self.shrink_streak = 0
        self.cooldown = self.cfg.cooldown_steps
        return size
