"""The scoring stage: between a rollout worker's hand-over and the replay queue, inside the controller.

A group arrives as a header (protocols/group_header.py) holding the ref of its tokens. The groups a worker hands
over in one call are scored together, as one batch: the stage sends their refs, in one task per role, to one
worker of every role the run has: a reward worker (unless the groups came with their rewards: a session's), which
returns each group's rewards and results; each token scorer (reference, teacher), which returns each group's
rows. Ray resolves the refs in each worker, so the tokens go from the object store to the workers that read them,
and the rows stay in the object store until a learner reads them: the stage awaits only each task's small first
return (the counts), never the rows. One task per hand-over, not per group, because a task's cost on the
controller (submission, its returns' bookkeeping) is mostly per task, not per group. (PPO's critic
scores the batch at train time, beside its update: cluster/critic_pool.py.)

One rule for every role, applied to a batch as a whole:
- a worker that died is marked dead (the driver replaces it, cluster/supervisor.py, and the stage takes the new
  list with `set_workers`); the role's task is sent to a live worker, at most `max_attempts` more times, then the
  batch's groups are dropped `<role>_worker_died`;
- a task that raises without its worker dying would raise again (a forward out of memory, a configure hook that
  failed): the run stops at once, with the error and the settings to change (`on_fatal`);
- every wait is bounded by `timeout_s`: a task that does not answer drops its groups `scoring_timeout`; a role
  without a live worker for that long drops them `<role>_worker_died`.

The stage is the one owner of which scoring workers are alive. It is plain Python over asyncio: the controller
actor runs it on its event loop, and the unit tests with stand-in workers (`call`).
"""

import asyncio
import logging
from collections import Counter
from typing import Any, Awaitable, Callable

from protocols.group_header import GroupHeader
from protocols.trajectory import TOKEN_SCORERS

log = logging.getLogger(__name__)

REWARD = "reward"
ROLES = (REWARD, *TOKEN_SCORERS)
"""Every scoring role, in the order a group's tasks are sent."""

METHODS = {REWARD: "score_groups", **{role: "score_rows" for role in TOKEN_SCORERS}}
"""Role -> the worker method, called with a batch's groups as arguments (`score_groups(*groups)`). The reward's
has one return: each group's (rewards, results). A token scorer's has one more return than there are groups: the
row counts (small: awaited), then each group's rows, whose refs the stage passes on unresolved."""


def num_returns(role: str, num_groups: int) -> int:
    return 1 if role == REWARD else 1 + num_groups


def ray_call(worker: Any, method: str, num_returns: int, payloads: list) -> Any:
    """`worker.method(*payloads)` as a Ray task (Ray resolves each ref argument in the worker): one ref, or a
    list of `num_returns` refs."""
    handle = getattr(worker, method)
    return (handle.remote(*payloads) if num_returns == 1
            else handle.options(num_returns=num_returns).remote(*payloads))


def worker_died(error: BaseException) -> bool:
    """Whether a task failed because its actor died (then it is worth sending to a live one)."""
    import ray

    return isinstance(error, ray.exceptions.RayActorError)


def drop_reason(role: str) -> str:
    return f"{role}_worker_died"


class ScoringStage:
    """The live workers of every scoring role and the groups being scored."""

    def __init__(self, max_attempts: int, timeout_s: float, on_scored: Callable[[GroupHeader], None],
                 on_dropped: Callable[[str, str], None], on_fatal: Callable[[str], None],
                 call: Callable[[Any, str, int, Any], Any] = ray_call,
                 died: Callable[[BaseException], bool] = worker_died) -> None:
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.on_scored, self.on_dropped, self.on_fatal = on_scored, on_dropped, on_fatal
        self._call, self._died = call, died
        self.workers: dict[str, list] = {role: [] for role in ROLES}
        """Role -> its live handles, as the driver last set them."""
        self.generation: Counter[str] = Counter()
        """Role -> lists set so far: a death seen on an older list does not mark an index of the newer one."""
        self.dead: dict[str, set[int]] = {role: set() for role in ROLES}
        self._turn: Counter[str] = Counter()
        self._changed: asyncio.Event | None = None
        self.pending: dict[str, asyncio.Task] = {}
        """group_id -> its batch's scoring task, until it is queued or dropped."""
        self.counts: Counter[str] = Counter({f"rescored_{drop_reason(role)}": 0 for role in ROLES})
        """`rescored_<reason>`: tasks sent again after their worker died, by the reason the group would drop with."""

    # --- workers ----------------------------------------------------------------------------------------------
    def set_workers(self, role: str, workers: list) -> int:
        """The live list of `role` (at start, after a replacement). Groups waiting for
        a worker of the role go on. Returns the role's new generation."""
        if role not in self.workers:
            raise ValueError(f"unknown scoring role {role!r}; the roles are {list(ROLES)}")
        self.workers[role] = list(workers)
        self.dead[role] = set()
        self.generation[role] += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        return self.generation[role]

    def roles_for(self, header: GroupHeader) -> list[str]:
        """The roles that score this group: the reward unless it came rewarded, and every other role that runs."""
        return [role for role in ROLES if (role != REWARD or not header.rewarded) and
                (self.workers[role] or role == REWARD)]

    def _live(self, role: str) -> list[int]:
        return [i for i in range(len(self.workers[role])) if i not in self.dead[role]]

    async def _pick(self, role: str, deadline: float) -> tuple[int, int] | None:
        """(index, generation) of the next live worker of `role` (round robin), waiting for a new list while
        none is alive; None when none came before `deadline`."""
        loop = asyncio.get_running_loop()
        while not (live := self._live(role)):
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return None
        self._turn[role] += 1
        return live[self._turn[role] % len(live)], self.generation[role]

    def _mark_dead(self, role: str, index: int, generation: int) -> None:
        if generation == self.generation[role]:
            self.dead[role].add(index)

    # --- groups -----------------------------------------------------------------------------------------------
    def submit(self, *headers: GroupHeader) -> None:
        """Start scoring the groups of one hand-over on the running event loop, one batch per set of roles; each
        group ends queued (`on_scored`) or dropped."""
        batches: dict[tuple[str, ...], list[GroupHeader]] = {}
        for header in headers:
            batches.setdefault(tuple(self.roles_for(header)), []).append(header)
        for roles, batch in batches.items():
            task = asyncio.get_running_loop().create_task(self._score(list(roles), batch))
            self.pending.update(dict.fromkeys((h.group_id for h in batch), task))

    async def _score(self, roles: list[str], headers: list[GroupHeader]) -> None:
        try:
            outcome = await self._run_roles(roles, headers)
        except Exception as err:  # a bug here must not lose the groups silently
            log.exception("scoring groups %s failed", [h.group_id for h in headers])
            outcome = ("fatal", f"scoring groups {[h.group_id for h in headers]} failed: {type(err).__name__}: {err}")
        finally:
            for header in headers:
                self.pending.pop(header.group_id, None)
        kind, value = outcome
        if kind == "scored":
            for header in value:
                self.on_scored(header)
            return
        if kind == "fatal":
            self.on_fatal(value)
            value = "scoring_failed"
        for header in headers:
            self.on_dropped(value, header.group_id)

    async def _run_roles(self, roles: list[str], headers: list[GroupHeader]) -> tuple[str, Any]:
        """("scored", the headers with rewards and score refs), ("dropped", reason) or ("fatal", message)."""
        loop = asyncio.get_running_loop()
        payloads = [header.ref if header.ref is not None else header.group for header in headers]
        attempts: Counter[str] = Counter()
        done: dict[str, Any] = {}
        todo = list(roles)
        while todo:
            deadline = loop.time() + self.timeout_s
            sent: dict[str, tuple[int, int, Any]] = {}
            for role in todo:
                pick = await self._pick(role, deadline)
                if pick is None:
                    return "dropped", drop_reason(role)
                returns = num_returns(role, len(headers))
                sent[role] = (*pick, self._call(self.workers[role][pick[0]], METHODS[role], returns, payloads))
            waits = [asyncio.wait_for(_first(refs), max(0.0, deadline - loop.time())) for *_, refs in sent.values()]
            outcomes = await asyncio.gather(*waits, return_exceptions=True)
            todo = []
            for (role, (index, generation, refs)), outcome in zip(sent.items(), outcomes):
                if not isinstance(outcome, BaseException):
                    done[role] = (outcome, refs)
                elif isinstance(outcome, asyncio.TimeoutError):
                    return "dropped", "scoring_timeout"
                elif self._died(outcome):
                    self._mark_dead(role, index, generation)
                    if attempts[role] >= self.max_attempts:
                        return "dropped", drop_reason(role)
                    attempts[role] += 1
                    self.counts[f"rescored_{drop_reason(role)}"] += 1
                    todo.append(role)
                else:
                    return "fatal", failure_message(role, index, [h.group_id for h in headers], outcome)
        return "scored", [_scored(header, k, done) for k, header in enumerate(headers)]


async def _first(refs: Any) -> Any:
    """The awaited value of a task's first (or only) return."""
    return await (refs[0] if isinstance(refs, list) else refs)


def _scored(header: GroupHeader, k: int, done: dict[str, tuple[Any, Any]]) -> GroupHeader:
    """`header`, the batch's `k`-th, with what each role returned for it: the reward's (rewards, results), the
    rows' ref."""
    if REWARD in done:
        rewards, results = done[REWARD][0][k]
        header = header.scored(rewards, results)
    scores = {role: refs[1 + k] for role, (_, refs) in done.items() if role != REWARD}
    return GroupHeader(**{**header.__dict__, "scores": {**header.scores, **scores}})


def failure_message(role: str, index: int, group_ids: list[str], err: BaseException) -> str:
    """Why the run stops when a worker of `role` raised on a batch without dying, and what to change."""
    name = role
    if role == REWARD:
        fix = ("the scorer gives reward 0 for a verifier's failure, so a raise is the worker's own (its verifier's "
               "configure hook, an import, reward.verifier): fix it and resume")
    else:
        off = ("set reference.num_workers=0 to score the reference inside the learner" if role == "reference"
               else f"set {name}.num_workers=0 to train without it")
        fix = (f"if it ran out of memory, lower {name}.max_tokens_per_micro_batch (0 scores in the learner's "
               f"micro-batches: learner.micro_batch_size or learner.max_tokens_per_micro_batch) or raise "
               f"{name}.gpus; or {off}")
    groups = f"group {group_ids[0]}" if len(group_ids) == 1 else f"groups {', '.join(group_ids)}"
    return (f"{name} worker {index} raised on {groups}: {type(err).__name__}: {err}. A worker that raises "
            f"is not retried (the same input would raise again), so the run stops: {fix}")
