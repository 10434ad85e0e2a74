"""Joining the scoring tasks of the groups a rollout worker hands the controller.

A rollout worker passes each scored group to the controller as the reward (or critic) task's ObjectRef, or,
when token-scoring workers run (reference, teacher), as a StreamedGroup of that ref and each role's task ref. The
controller (actors/controller.py) awaits them here and sorts each outcome: a scored group, a token scorer's
failure (the run stops) or death (re-scored), a critic's death, a reward worker's death (the group is worth
re-scoring elsewhere), or another failure.
"""

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from protocols.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)


@dataclass
class StreamedGroup:
    """A group on its way to the queue when token-scoring workers run: the reward task and one task per role
    (reference, teacher) were started together on the same group, and the controller joins them."""

    scored: Any
    """ObjectRef of the reward worker's scored TrajectoryGroup."""
    token_scores: dict[str, tuple[Any, int]] = field(default_factory=dict)
    """Role -> (ObjectRef of that worker's log-probs, one list per trajectory; the worker's index, for errors)."""

    def tasks(self) -> list[Any]:
        return [task for task, _ in self.token_scores.values()]


class ScorerFailed(RuntimeError):
    """A token-scoring worker's task for a group failed (the worker died, ran out of memory, or raised)."""

    def __init__(self, role: str, worker: int, cause: BaseException) -> None:
        super().__init__(f"{role} worker {worker}: {type(cause).__name__}: {cause}")
        self.role = role
        self.worker = worker
        self.cause = cause


@dataclass
class JoinedGroups:
    """The outcomes of one call's scoring tasks, sorted."""

    scored: list[tuple[str, TrajectoryGroup]] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> group ids dropped: `<role>_failed` (reference, teacher), `critic_failed` or `reward_failed`."""
    died: list[str] = field(default_factory=list)
    """Groups whose reward worker died before scoring them: worth sending to a live one."""
    scorer_died: dict[str, list[str]] = field(default_factory=dict)
    """Role -> groups whose worker of that token-scoring role died before scoring them: sent again once the driver
    replaced it."""
    critic_died: list[str] = field(default_factory=list)
    """Groups whose critic worker died before stamping them: sent again once the critic group restarted."""
    scorer_failures: list[tuple[str, ScorerFailed]] = field(default_factory=list)
    """(group id, error) of each token scorer's failure, for the controller to stop the run by name."""


async def resolve_all(items: list[Any]) -> list[TrajectoryGroup | BaseException]:
    """Await every item (a task's ObjectRef or a StreamedGroup) together; a failure is returned, not raised."""
    return await asyncio.gather(*(_resolve(item) for item in items), return_exceptions=True)


def sort_results(group_ids: list[str], results: list[TrajectoryGroup | BaseException],
                 critic_actor_ids: set[str]) -> JoinedGroups:
    """Sort `resolve_all`'s results. A dead reward, token-scoring or critic worker's group is worth sending again
    (each role is replaced by the driver, cluster/supervisor.py); a critic's death is never taken for a reward
    worker's. A token scorer's forward that raised, or any other failure, drops the group."""
    joined = JoinedGroups()
    for group_id, result in zip(group_ids, results):
        if isinstance(result, TrajectoryGroup):
            joined.scored.append((group_id, result))
        elif isinstance(result, ScorerFailed) and actor_died(result.cause):
            joined.scorer_died.setdefault(result.role, []).append(group_id)
        elif isinstance(result, ScorerFailed):
            joined.scorer_failures.append((group_id, result))
            joined.failed.setdefault(f"{result.role}_failed", []).append(group_id)
        elif actor_died(result) and getattr(result, "actor_id", None) in critic_actor_ids:
            joined.critic_died.append(group_id)
        elif actor_died(result):
            joined.died.append(group_id)
        else:
            log.warning("scoring failed on group %s (reward or critic worker): %s", group_id, result)
            joined.failed.setdefault("reward_failed", []).append(group_id)
    return joined


def actor_died(error: BaseException) -> bool:
    """Whether a reward task failed because its actor died (then the group is worth sending elsewhere)."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError)


async def _resolve(item: Any) -> TrajectoryGroup:
    """The scored group an item of SyncRequest.scored stands for, each token scorer's log-probs attached when it
    is a StreamedGroup. A reward failure raises as it came; a token scorer's failure raises ScorerFailed."""
    if not isinstance(item, StreamedGroup):
        return await item
    group = await item.scored
    for role, (task, worker) in item.token_scores.items():
        try:
            rows = await task
        except Exception as err:  # any failure of the task: died, out of memory, an exception in the forward
            raise ScorerFailed(role, worker, err) from err
        group = group.with_token_scores(role, rows)
    return group
