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
    """(group_id, GroupHeader) of each finished group, without its tokens: the controller takes the group from
    the worker's `outbox` by a task (so it owns it). A TrajectoryGroup, or a header holding its group inline, is
    handed over whole (the simulator, the unit tests)."""
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> group ids the worker abandoned (for example aborted when the run stopped)."""
    stats: dict | None = None
    """The worker's counters, replacing its previous report."""
    final: bool = False
    """The worker's last call (it stopped)."""
    outbox: Any = None
    """The worker's actor handle: the controller takes the handed-over groups from it (`take_groups`)."""


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


@dataclass
class WatchReply:
    stop: bool
    weights: WeightAnnouncement | None
    budget_freed: bool = False
