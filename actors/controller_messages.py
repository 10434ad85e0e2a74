"""The messages between a rollout worker and the controller (actors/controller.py).

A worker makes one `sync` call per batch of groups (SyncRequest -> SyncReply) and keeps one long poll, `watch`,
open (-> WatchReply). They are plain dataclasses, so the simulator passes them without Ray.
"""

from dataclasses import dataclass, field
from typing import Any

from protocols.trajectory import Prompt
from protocols.weight_announcement import WeightAnnouncement


@dataclass
class SyncRequest:
    """What a rollout worker hands the controller in one call."""

    worker_id: int
    version: int
    """The policy version the worker's engine holds; admission is computed for it."""
    in_flight: int = 0
    """Groups the worker is still generating (the fair-share rule at max_staleness 0)."""
    want: int = 0
    """Groups it asks for now; 0 asks for none."""
    scored: list[tuple[str, Any]] = field(default_factory=list)
    """(group_id, scored TrajectoryGroup, the reward task's ObjectRef, or a StreamedGroup of reward and reference
    refs). Refs sit inside this record, so Ray passes them unresolved and the data goes reward (and reference)
    worker -> controller, never through the rollout worker."""
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> group ids the worker abandoned (for example aborted when the run stopped)."""
    stats: dict | None = None
    """The worker's counters, replacing its previous report."""
    reward_generation: int = 0
    """The generation of the reward worker list the worker sends to; an older one gets the live list back."""
    final: bool = False
    """The worker's last call (it stopped): scoring that failed cannot be retried, so it is dropped."""
    model_generation: int = 0
    """The generation of the token-scoring (reference, teacher) and critic worker lists the worker sends to (see
    `model_workers`)."""


@dataclass
class SyncReply:
    stop: bool
    weights: WeightAnnouncement | None
    """The newest weights when newer than the request's version; then nothing is granted, since a worker
    loads new weights before it takes more work (the admission rule is per version)."""
    granted: list[tuple[str, Prompt]] = field(default_factory=list)
    starved: bool = False
    """Fewer groups were granted than asked because the admission budget is spent: the worker is registered as
    waiting, and its `watch` returns when budget is freed (a drop) or new weights are published."""
    max_in_flight: int | None = None
    """At max_staleness 0, the worker's fair share of groups in flight: it asks again only below it."""
    expected_lengths: dict[str, float] = field(default_factory=dict)
    """With rollout.length_aware_dispatch: group_id -> expected response tokens of each granted group
    (actors/length_history.py), so the worker's engine starts the long ones first; empty otherwise."""
    rescore: list[str] = field(default_factory=list)
    """Groups of this call whose reward worker died before scoring them: send them to a live one (their leases
    stay with the worker)."""
    reward_workers: tuple[int, list] | None = None
    """(generation, the live reward worker handles) when newer than the request's generation."""
    rescore_model: dict[str, list[str]] = field(default_factory=dict)
    """Token-scoring role (reference, teacher) -> groups of this call whose worker of that role died before
    scoring them: send them again (every stage), to a live worker of the role."""
    rescore_critic: list[str] = field(default_factory=list)
    """Groups of this call whose critic worker died before stamping them: send them again once the restarted
    critic group's handles arrive (`model_workers`)."""
    model_workers: tuple[int, dict[str, list]] | None = None
    """(generation, {"reference": handles, "teacher": handles, "critic": handles}) after the driver replaced a
    token-scoring worker or restarted the critic group, when newer than the request's generation
    (cluster/supervisor.py)."""


@dataclass
class WatchReply:
    stop: bool
    weights: WeightAnnouncement | None
    budget_freed: bool = False
