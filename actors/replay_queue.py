"""The replay queue: scored groups wait here between the reward workers and the learner.

It is plain Python (no Ray) so tests and the simulator drive it directly; `actors/controller.py` hosts it in a
Ray actor. It holds group headers (protocols/group_header.py: the ref of a group's tokens and its numbers), keeps
groups whole, enforces staleness in policy versions, drops zero-signal groups when asked, and counts every group
it receives as exactly one of: waiting, trained, or dropped with a reason.
"""

from collections import Counter, deque

from protocols.group_header import GroupHeader
from protocols.metrics import length_metrics
from protocols.trajectory import TrajectoryGroup


GENERATED_WINDOW = 1 << 20
"""Samples the `generated/` metrics keep between reads at most (a few MB)."""


def group_has_signal(rewards: list[float]) -> bool:
    """A group whose rewards are all equal gives every sample zero advantage: it carries no learning signal."""
    return max(rewards) != min(rewards)


class ReplayQueue:
    """FIFO of whole groups, stamped with the oldest policy version that produced any of their tokens."""

    def __init__(self, max_staleness: int, drop_zero_variance: bool) -> None:
        self.max_staleness = max_staleness
        self.drop_zero_variance = drop_zero_variance
        self._groups: deque[GroupHeader] = deque()
        self.received = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()
        self.zero_variance_rewarded = 0
        """Groups dropped as zero variance whose samples were all rewarded (too easy); the rest earned nothing."""
        self._generated: deque[tuple[int, bool]] = deque(maxlen=GENERATED_WINDOW)
        """(response tokens, truncated) of the samples received since the last `generated_metrics()`: the newest
        GENERATED_WINDOW, so a queue nobody reads (the simulator's) stays bounded."""

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: GroupHeader | TrajectoryGroup) -> bool:
        """Add a scored group (a TrajectoryGroup is held inline). Returns False when it was dropped (and counted)
        instead of queued."""
        if isinstance(group, TrajectoryGroup):
            group = GroupHeader.of(group, rewarded=True)
        self.received += 1
        # truncated as the trained batch counts it (response/truncated_frac): out of tokens or of turns
        self._generated.extend(zip(group.response_lengths, group.truncated))
        if self.drop_zero_variance and not group_has_signal(group.rewards):
            self.dropped["zero_variance"] += 1
            self.zero_variance_rewarded += group.rewards[0] > 0
            return False
        self._groups.append(group)
        return True

    def headers(self) -> list[GroupHeader]:
        """The queued groups, oldest first."""
        return list(self._groups)

    def drop_stale(self, learner_version: int) -> int:
        """Drop groups whose oldest token is more than max_staleness versions behind the learner (`stale`)."""
        oldest_allowed = learner_version - self.max_staleness
        if all(g.min_version >= oldest_allowed for g in self._groups):
            return 0
        kept = deque(g for g in self._groups if g.min_version >= oldest_allowed)
        dropped = len(self._groups) - len(kept)
        self.dropped["stale"] += dropped
        self._groups = kept
        return dropped

    def take(self, num_groups: int, learner_version: int) -> list[GroupHeader] | None:
        """The next `num_groups` fresh-enough groups, or None (nothing removed) while fewer are waiting."""
        self.drop_stale(learner_version)
        if len(self._groups) < num_groups:
            return None
        batch = [self._groups.popleft() for _ in range(num_groups)]
        self.trained += num_groups
        return batch

    def generated_metrics(self) -> dict[str, float]:
        """Lengths of every sample received since the last call, trained or dropped (`generated/` metrics), then
        forgets them: the trained batch alone hides what the policy writes for problems it never solves."""
        samples = list(self._generated)
        self._generated.clear()
        if not samples:
            return {"generated/samples": 0.0}
        lengths = [n for n, _ in samples]
        return {"generated/samples": float(len(samples)), "generated/length_mean": sum(lengths) / len(lengths),
                **length_metrics(lengths, prefix="generated/"),
                "generated/truncated_frac": sum(cut for _, cut in samples) / len(samples)}

    def state_dict(self, groups: list[TrajectoryGroup] | None = None) -> dict:
        """`groups`: the queued groups assembled (GroupHeader.assemble), in queue order; None when every header
        holds its group inline."""
        groups = [h.inline() for h in self._groups] if groups is None else groups
        return {
            "groups": [g.model_dump(mode="json") for g in groups],
            "received": self.received,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "zero_variance_rewarded": self.zero_variance_rewarded,
        }

    def load_state_dict(self, state: dict) -> None:
        groups = (TrajectoryGroup.model_validate(_current(g)) for g in state["groups"])
        self._groups = deque(GroupHeader.of(g, rewarded=True) for g in groups)
        self.received = state["received"]
        self.trained = state["trained"]
        self.dropped = Counter(state["dropped"])
        self.zero_variance_rewarded = state.get("zero_variance_rewarded", 0)  # absent from older checkpoints


RETIRED_FIELDS = ("values", "critic_version")
"""Trajectory fields of older checkpoints (the critic's values, once stamped in the stream, now computed at train
time): a queued group saved with them loads without them."""


def _current(group: dict) -> dict:
    for t in group.get("trajectories", []):
        for name in RETIRED_FIELDS:
            t.pop(name, None)
    return group
