"""What the control plane knows of a group: its id, where its tokens are, and numbers.

A rollout worker puts each finished TrajectoryGroup into the object store once and hands the controller a
GroupHeader: the object's ref and the few numbers admission, staleness and metrics read (versions, lengths).
The scoring stage (actors/scoring_stage.py) adds the rewards and the refs of the token scorers' rows; the replay
queue holds headers; the driver fetches the tokens by ref (cluster/group_fetch.py). The controller never
deserializes a token.

A header built without a ref holds its group inline (`group`): the simulator, the unit tests and a queue loaded
from a checkpoint pass groups that way, and everything downstream reads both the same.
"""

from dataclasses import dataclass, field, replace
from typing import Any

from protocols.trajectory import TrajectoryGroup, VerifierResult

@dataclass
class GroupHeader:
    """One group on the control plane. Lists hold one entry per sample, in order."""

    group_id: str
    prompt_id: str
    response_lengths: list[int]
    """Response tokens of each sample (tool and context tokens included)."""
    truncated: list[bool]
    """Each sample ran out of tokens or turns (Trajectory.truncated)."""
    min_version: int
    """Oldest policy version that sampled a token of the group: the queue's staleness reads it."""
    max_version: int
    ref: Any = None
    """ObjectRef of the TrajectoryGroup as the rollout worker made it (owned by the controller, so the group
    outlives its worker); None when `group` is inline."""
    group: TrajectoryGroup | None = None
    """The group itself, inline, when there is no ref."""
    rewards: list[float] | None = None
    """Each sample's reward: the reward worker's, or the client's for a session's group. None until scored."""
    results: list[VerifierResult | None] | None = None
    """Each sample's verifier result (None for a reward the client gave)."""
    scores: dict[str, Any] = field(default_factory=dict)
    """Token scorer's role (reference, teacher) -> ObjectRef of its rows (one list per sample), or the rows
    themselves for an inline group. The driver attaches them (TrajectoryGroup.with_token_scores)."""

    @classmethod
    def of(cls, group: TrajectoryGroup, ref: Any = None, rewarded: bool = False) -> "GroupHeader":
        """The header of `group`, walking its tokens once. `ref`: where it was put (None keeps it inline).
        `rewarded`: its samples already carry their rewards (a session's group, or a scored one)."""
        trajs = group.trajectories
        spans = [t.version_span for t in trajs]
        return cls(group_id=group.group_id, prompt_id=trajs[0].prompt.prompt_id if trajs else "",
                   response_lengths=[len(t.response_token_ids) for t in trajs],
                   truncated=[t.truncated for t in trajs],
                   min_version=min((lo for lo, _ in spans), default=-1),
                   max_version=max((hi for _, hi in spans), default=-1),
                   ref=ref, group=None if ref is not None else group,
                   rewards=[t.reward for t in trajs] if rewarded else None,
                   results=[t.result for t in trajs] if rewarded else None)

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    @property
    def rewarded(self) -> bool:
        return self.rewards is not None

    def scored(self, rewards: list[float], results: list[VerifierResult | None]) -> "GroupHeader":
        """A copy carrying the reward worker's rewards and results."""
        if len(rewards) != self.num_samples or len(results) != self.num_samples:
            raise ValueError(f"group {self.group_id}: {len(rewards)} rewards and {len(results)} results for its "
                             f"{self.num_samples} samples")
        return replace(self, rewards=list(rewards), results=list(results))

    def assemble(self, group: TrajectoryGroup, scores: dict[str, Any]) -> TrajectoryGroup:
        """The group as the learner reads it: `group` (fetched by ref, or inline) with the rewards, results and
        token scorers' rows of this header attached. `scores`: role -> fetched rows."""
        trajs = group.trajectories
        if self.rewards is not None:
            trajs = [t.model_copy(update={"reward": r, "result": res})
                     for t, r, res in zip(trajs, self.rewards, self.results or [None] * len(trajs), strict=True)]
        out = group.model_copy(update={"trajectories": trajs})
        for role, rows in scores.items():
            out = out.with_token_scores(role, rows)
        return out

    def inline(self) -> TrajectoryGroup:
        """The assembled group of an inline header (its scores are rows, not refs)."""
        if self.group is None:
            raise ValueError(f"group {self.group_id} is in the object store (ref), not inline: fetch it by ref")
        return self.assemble(self.group, self.scores)
