"""`rollout.autoscale`: the settings of the rollout autoscaler (cluster/autoscaler.py), off by default."""

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AutoscaleConfig(BaseModel):
    """`rollout.autoscale`: resize the rollout pool from what the run measures."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Off by default: the pool keeps rollout.num_workers unless `relayrl scale` changes it."""

    min_workers: int = Field(1, ge=1)
    """The pool never shrinks below this."""

    max_workers: int = Field(4, ge=1)
    """The pool never grows past this. Workers past the launch placement's bundles start with plain resources
    wherever the cluster has room (on an autoscaling cluster, Ray's autoscaler adds nodes for them)."""

    grow_wait_frac: float = Field(0.1, gt=0, le=1)
    """Grow when the learner spends more than this share of its step waiting for a batch. 0.1 keeps the learner
    at least about 90% busy; a higher value lets it idle up to that share for good (at 0.3 the simulator's
    growing-length run held the learner 81% busy)."""

    shrink_wait_frac: float = Field(0.02, ge=0, lt=1)
    """Shrink only when the learner waits less than this share (and the queue is full or drops stale groups)."""

    shrink_queue_batches: int = Field(2, ge=1)
    """Shrink on a full queue only when it holds at least this many learner batches. One batch queued is what a
    pool of the right size shows too (generation runs ahead within train.max_staleness); shrinking on it starved
    the learner in the simulator's growing-length run (docs/elastic.md)."""

    patience_steps: int = Field(3, ge=1)
    """Steps in a row a signal must hold before the pool changes."""

    cooldown_steps: int = Field(5, ge=0)
    """Steps after a change during which the pool does not change again."""

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscaleConfig":
        if self.min_workers > self.max_workers:
            raise ValueError(f"rollout.autoscale.min_workers={self.min_workers} is above max_workers="
                             f"{self.max_workers}: set min_workers <= max_workers")
        if self.shrink_wait_frac >= self.grow_wait_frac:
            raise ValueError(f"rollout.autoscale.shrink_wait_frac={self.shrink_wait_frac} must be below "
                             f"grow_wait_frac={self.grow_wait_frac}, or the pool would grow and shrink on the same "
                             "signal")
        return self
