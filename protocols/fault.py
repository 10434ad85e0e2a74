"""The `fault:` section: how the driver notices a dead actor, replaces it, and how long each of its waits may
last (cluster/supervisor.py, cluster/waits.py, actors/scoring_stage.py)."""

from pydantic import BaseModel, ConfigDict, Field


class FaultConfig(BaseModel):
    """Worker failure: how the driver notices a dead actor, replaces it, and how long each of its waits may last.
    Every limit below is named in the error raised when it runs out."""

    model_config = ConfigDict(extra="forbid")

    max_replacements: int = Field(3, ge=0, le=1000)
    """Replacements allowed per role (rollout, reward, reference; critic: restarts of the whole critic group) over
    the run; one more death stops the run with an error
    (a worker that keeps dying points at a bug or a bad node, not bad luck). 0 stops at the first death."""

    health_check_s: float = Field(1.0, gt=0, le=600)
    """How often, while waiting for a batch, the driver checks that every rollout, reward, reference and critic
    worker is alive."""

    batch_timeout_s: float = Field(1800.0, gt=0, le=86_400)
    """Longest the driver waits for one training batch from the queue (workers alive but producing nothing)."""

    worker_start_timeout_s: float = Field(900.0, gt=0, le=86_400)
    """Longest a replacement worker may take to start (vLLM engine start, weight load) or a worker to stop."""

    learner_timeout_s: float = Field(3600.0, gt=0, le=86_400)
    """Longest one learner or critic call (a training step, a weight publish, a values pass, a save) may take on
    every rank."""

    wait_log_s: float = Field(60.0, gt=0, le=86_400)
    """While the driver waits for a batch, it logs what it waits for every this many seconds (groups queued and in
    flight; with gateway.outside_only, the sessions outside agents opened, rewarded and left without a reward,
    and where the endpoints are listed), so a stalled run says why before fault.batch_timeout_s ends it."""

    scoring_timeout_s: float = Field(1800.0, gt=0, le=86_400)
    """Longest the scoring stage waits for one group's task of a role (a reward, reference or teacher worker), or
    for a live worker of a role to send it to; past it the group is dropped `scoring_timeout` (or
    `<role>_worker_died`) and counted."""

    call_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """Longest the driver waits for a call that only reads or records (the controller's stats, publish, state
    and resume; a worker's counters or weight probes). Past it the run stops naming the call: such a call
    answers in milliseconds unless its actor hangs."""

    eval_timeout_s: float = Field(3600.0, gt=0, le=86_400)
    """Longest one held-out evaluation's generation may take on the rollout workers (every prompt of the split,
    all workers together); past it the run stops naming it."""

    max_rescore_attempts: int = Field(2, ge=0, le=100)
    """Times a group whose reward (or reference) worker died is sent to a live one before it is dropped
    (counted as `queue/dropped_reward_worker_died` or `queue/dropped_reference_worker_died`)."""
