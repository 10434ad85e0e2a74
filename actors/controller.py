"""The rollout controller: one Ray actor that owns the run's shared state.

It owns the prompt cursor, the admission budget that bounds staleness and memory, the leases of the groups in
flight, the replay queue, and the latest published weights. Its load grows with groups, not decode steps: a
rollout worker makes one `sync` call per batch of groups (hand over scored groups, ask for prompts, report
stats) and keeps one long poll (`watch`) open that returns when new weights are published, the run stops, or
admission budget it waits for is freed. The driver takes batches and publishes weights. The logic is plain
Python and serializable (`state_dict`), so the simulator and the checkpoints use the same class;
`ControllerActor` adds the two asynchronous Ray entry points.
"""

import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.replay_queue import ReplayQueue
from protocols.trajectory import Prompt, TrajectoryGroup, WeightVersion

log = logging.getLogger(__name__)


class PromptCursor:
    """Endless shuffled pass over the training prompts; the (epoch, index) pair is the data position."""

    def __init__(self, prompts: list[Prompt], seed: int) -> None:
        if not prompts:
            raise ValueError("the training set is empty after filtering; check data.train_path and data.max_prompt_tokens")
        self.prompts = prompts
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> Prompt:
        if self.index == len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._shuffled(self.epoch)
        prompt = self.prompts[self._order[self.index]]
        self.index += 1
        return prompt

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)


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
    """(group_id, scored TrajectoryGroup or the reward task's ObjectRef). Refs sit inside this record, so Ray
    passes them unresolved and the data goes reward worker -> controller, never through the rollout worker."""
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Reason -> group ids the worker abandoned (for example aborted when the run stopped)."""
    stats: dict | None = None
    """The worker's counters, replacing its previous report."""


@dataclass
class SyncReply:
    stop: bool
    weights: tuple[int, list] | None
    """(version, [weights ref]) when newer than the request's version; then nothing is granted, since a worker
    loads new weights before it takes more work (the admission rule is per version)."""
    granted: list[tuple[str, Prompt]] = field(default_factory=list)
    starved: bool = False
    """Fewer groups were granted than asked because the admission budget is spent: the worker is registered as
    waiting, and its `watch` returns when budget is freed (a drop) or new weights are published."""
    max_in_flight: int | None = None
    """At max_staleness 0, the worker's fair share of groups in flight: it asks again only below it."""


@dataclass
class WatchReply:
    stop: bool
    weights: tuple[int, list] | None
    budget_freed: bool = False


class RolloutController:
    """Admission, leases, queue and weights. Admission rule (AReaL's staleness control, Fu et al. 2025, sec. 5.1):
    a worker holding policy version w may start a group only while

        admitted - dropped < (w + max_staleness + 1) * prompts_per_step

    so at most (max_staleness + 1) batches are queued or in flight: memory stays bounded and workers slow down by
    themselves. Groups that finish out of order can still arrive too old; the queue drops and counts those, which
    is what enforces the bound. A group is as old as its oldest token, so max_staleness must cover the longest
    responses: roughly k >= (longest / mean response length) * (engine slots / samples per batch) + 1.

    At max_staleness 0, each worker is granted at most its fair share ceil(prompts_per_step / num_workers) of
    groups in flight, so one fast-asking worker does not take the whole batch while the others idle.

    Every admitted group is leased to the worker that holds it (worker id, time) until it comes back scored or
    dropped; `release_worker` drops a lost worker's leases (counted as `worker_lost`), so the admission window
    never shrinks, and a late arrival of a released group is ignored. Calls are counted by method (`calls`).
    """

    def __init__(self, prompts: list[Prompt], prompts_per_step: int, max_staleness: int,
                 drop_zero_variance: bool, seed: int, num_workers: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cursor = PromptCursor(prompts, seed)
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.num_workers = num_workers
        self.queue = ReplayQueue(max_staleness, drop_zero_variance)
        self.admitted = 0
        self.learner_version = 0
        self.stopped = False
        self._weights: tuple[int, list] = (0, [])
        self.published: list[WeightVersion] = []
        self.worker_stats: dict[int, dict] = {}
        self.clock = clock
        self.leases: dict[str, tuple[int, float]] = {}
        """group_id -> (worker_id, time admitted) for every group admitted and not yet back."""
        self.released: set[str] = set()
        self.late_after_release = 0
        self.calls: Counter[str] = Counter()
        # starved worker -> (its version, groups it still wants), oldest first; and those whose watch should return
        self._waiting: dict[int, tuple[int, int]] = {}
        self._woken: set[int] = set()
        self._dropped_seen = 0

    # --- rollout workers -------------------------------------------------------------------------------------
    def budget(self, worker_version: int) -> int:
        dropped = sum(self.queue.dropped.values())
        limit = (worker_version + self.max_staleness + 1) * self.prompts_per_step
        return max(0, limit - (self.admitted - dropped))

    def acquire(self, worker_id: int, worker_version: int, max_groups: int,
                in_flight: int = 0) -> tuple[bool, list[tuple[str, Prompt]]]:
        """Up to `max_groups` prompts the worker may start now, as (group_id, prompt); first value: stop flag.
        `in_flight` is the number of groups the worker is still generating."""
        self.calls["acquire"] += 1
        if self.stopped:
            return True, []
        return False, self._admit(worker_id, worker_version, max_groups, in_flight)

    def _admit(self, worker_id: int, worker_version: int, max_groups: int, in_flight: int) -> list:
        if self.max_staleness == 0:
            fair_share = -(-self.prompts_per_step // self.num_workers)
            max_groups = min(max_groups, fair_share - in_flight)
        granted = []
        now = self.clock()
        for _ in range(min(max_groups, self.budget(worker_version))):
            group_id = f"g{self.admitted}"
            self.admitted += 1
            self.leases[group_id] = (worker_id, now)
            granted.append((group_id, self.cursor.next()))
        return granted

    def sync(self, request: SyncRequest) -> SyncReply:
        """One worker call: take its scored and abandoned groups, record its stats, then answer with the stop
        flag, newer weights, or the groups it may start. Scored groups go first, so budget their drops free is
        granted in the same call."""
        self.calls["sync"] += 1
        for group_id, group in request.scored:
            self._put(group)
        for reason, group_ids in request.dropped.items():
            self._drop(reason, group_ids)
        if request.stats is not None:
            self.worker_stats[request.worker_id] = request.stats
        self._waiting.pop(request.worker_id, None)
        self._woken.discard(request.worker_id)
        reply = SyncReply(stop=self.stopped, weights=self.latest_weights(request.version))
        if self.max_staleness == 0:
            reply.max_in_flight = -(-self.prompts_per_step // self.num_workers)
        if not reply.stop and reply.weights is None and request.want > 0:
            reply.granted = self._admit(request.worker_id, request.version, request.want, request.in_flight)
            if len(reply.granted) < request.want and self.budget(request.version) == 0:
                reply.starved = True
                self._waiting[request.worker_id] = (request.version, request.want - len(reply.granted))
        self._wake_waiters()
        return reply

    def watch_news(self, worker_id: int, known_version: int) -> WatchReply | None:
        """What a worker's long poll returns now, or None while there is nothing new for it."""
        weights = self.latest_weights(known_version)
        if self.stopped or weights is not None:
            return WatchReply(stop=self.stopped, weights=weights)
        if worker_id in self._woken:
            self._woken.discard(worker_id)
            return WatchReply(stop=False, weights=None, budget_freed=True)
        return None

    def take_woken(self) -> set[int]:
        """Workers woken for freed budget since the last call (the simulator delivers their watch replies)."""
        return set(self._woken)

    def poll(self, known_version: int) -> tuple[bool, tuple[int, list] | None]:
        """(stop flag, newer weights or None) in one call; workers use `watch` instead."""
        self.calls["poll"] += 1
        return self.stopped, self.latest_weights(known_version)

    def latest_weights(self, known_version: int) -> tuple[int, list] | None:
        """(version, [weights ref]) when newer than `known_version`, else None."""
        version, refs = self._weights
        return (version, refs) if version > known_version else None

    def _wake_waiters(self) -> None:
        """After drops freed budget, wake waiting workers, oldest first, as far as the freed budget reaches."""
        dropped = sum(self.queue.dropped.values())
        if dropped == self._dropped_seen:
            return
        self._dropped_seen = dropped
        taken, woken = 0, []
        for worker_id, (version, want) in self._waiting.items():
            room = self.budget(version) - taken
            if room > 0:
                taken += min(want, room)
                woken.append(worker_id)
        for worker_id in woken:
            del self._waiting[worker_id]
        if woken:
            self._woken.update(woken)
            self._notify()

    def _notify(self) -> None:
        """Hook: state a `watch` may be waiting for changed (the Ray actor wakes its long polls)."""

    # --- leases ------------------------------------------------------------------------------------------------
    def _end_lease(self, group_id: str) -> bool:
        """False when the group's lease was released earlier (its worker was declared lost): ignore it."""
        if group_id in self.released:
            self.released.discard(group_id)
            self.late_after_release += 1
            return False
        self.leases.pop(group_id, None)
        return True

    def leases_of(self, worker_id: int) -> list[str]:
        return [g for g, (w, _) in self.leases.items() if w == worker_id]

    def release_worker(self, worker_id: int) -> list[str]:
        """Drop every group leased to a lost worker (reason `worker_lost`), freeing its admission budget."""
        self.calls["release_worker"] += 1
        group_ids = self.leases_of(worker_id)
        for group_id in group_ids:
            del self.leases[group_id]
        self.released.update(group_ids)
        self.queue.received += len(group_ids)
        self.queue.dropped["worker_lost"] += len(group_ids)
        self._waiting.pop(worker_id, None)
        self._wake_waiters()
        return group_ids

    # --- reward workers ----------------------------------------------------------------------------------------
    def put(self, group: TrajectoryGroup) -> bool:
        self.calls["put"] += 1
        queued = self._put(group)
        self._wake_waiters()
        return queued

    def _put(self, group: TrajectoryGroup) -> bool:
        if not self._end_lease(group.group_id):
            return False
        queued = self.queue.put(group)
        if queued:
            self._queue_grew()
        return queued

    def _queue_grew(self) -> None:
        """Hook: a batch may be ready (the Ray actor wakes the driver's `wait_batch`)."""

    def report_dropped(self, reason: str, count: int = 1, group_ids: list[str] | None = None) -> None:
        """Groups a worker abandoned (for example its requests failed); they free admission budget. With
        `group_ids` their leases end too."""
        self.calls["report_dropped"] += 1
        if group_ids is None:
            self.queue.received += count
            self.queue.dropped[reason] += count
        else:
            self._drop(reason, group_ids)
        self._wake_waiters()

    def _drop(self, reason: str, group_ids: list[str]) -> None:
        count = sum(self._end_lease(g) for g in group_ids)
        self.queue.received += count
        self.queue.dropped[reason] += count

    # --- driver ------------------------------------------------------------------------------------------------
    def take_batch(self, learner_version: int) -> list[TrajectoryGroup] | None:
        self.calls["take_batch"] += 1
        return self._take_batch(learner_version)

    def _take_batch(self, learner_version: int) -> list[TrajectoryGroup] | None:
        self.learner_version = learner_version
        batch = self.queue.take(self.prompts_per_step, learner_version)
        self._wake_waiters()  # stale drops free budget
        return batch

    def publish(self, weights: WeightVersion, refs: list) -> None:
        """Make `weights.version` the newest weights. `refs` is a list so Ray passes the object refs through
        unresolved (the tensors stay in the object store until a worker loads them)."""
        self.calls["publish"] += 1
        self._weights = (weights.version, refs)
        self.published.append(weights)
        self.learner_version = weights.version
        # every worker's watch returns with the new weights; after loading them it asks again
        self._waiting.clear()
        self._woken.clear()
        self._notify()

    def report_worker_stats(self, worker_id: int, stats: dict) -> None:
        self.calls["report_worker_stats"] += 1
        self.worker_stats[worker_id] = stats

    def stop(self) -> None:
        self.stopped = True
        self._notify()

    def resume(self) -> None:
        self.stopped = False
        self._notify()

    def stats(self) -> dict[str, float]:
        q = self.queue
        in_flight = self.admitted - q.received
        out = {
            "queue/depth": len(q),
            "queue/admitted": self.admitted,
            "queue/received": q.received,
            "queue/trained": q.trained,
            "queue/in_flight": in_flight,
            "queue/leased": len(self.leases),
            "queue/late_after_release": self.late_after_release,
            "data/epoch": self.cursor.epoch,
        }
        out.update({f"queue/dropped_{reason}": n for reason, n in q.dropped.items()})
        out.update({f"control/calls_{method}": n for method, n in self.calls.items()})
        return out

    def get_worker_stats(self) -> dict[int, dict]:
        return dict(self.worker_stats)

    def state_dict(self) -> dict:
        return {
            "cursor": self.cursor.state_dict(),
            "queue": self.queue.state_dict(),
            "admitted": self.admitted,
            "learner_version": self.learner_version,
            "leases": {g: [w, t] for g, (w, t) in self.leases.items()},
            "released": sorted(self.released),
        }

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state["cursor"])
        self.queue.load_state_dict(state["queue"])
        self.admitted = state["admitted"]
        self.learner_version = state["learner_version"]
        self.leases = {g: (w, t) for g, (w, t) in state.get("leases", {}).items()}
        self.released = set(state.get("released", []))
        self._dropped_seen = sum(self.queue.dropped.values())


class ControllerActor(RolloutController):
    """The controller hosted as an asynchronous Ray actor (`ray.remote(ControllerActor)`). Its plain methods run
    on the actor's event loop one at a time, as before; `watch` waits there without holding it, and `sync`
    awaits the scored groups' object refs (a failed reward task counts as dropped `reward_failed`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._changed: asyncio.Event | None = None
        self._grew: asyncio.Event | None = None  # separate, so a queued group does not wake every watch

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _queue_grew(self) -> None:
        if self._grew is not None:
            self._grew.set()
            self._grew = None

    async def wait_batch(self, learner_version: int, timeout_s: float = 1.0) -> list[TrajectoryGroup] | None:
        """Long poll for `take_batch`: the next batch once it is complete, or None after `timeout_s`, so the
        driver makes about one call per step instead of polling."""
        self.calls["wait_batch"] += 1
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (batch := self._take_batch(learner_version)) is None:
            if self._grew is None:
                self._grew = asyncio.Event()
            try:
                await asyncio.wait_for(self._grew.wait(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return None
        return batch

    async def watch(self, worker_id: int, known_version: int) -> WatchReply:
        """Long poll: returns once there is news for this worker (newer weights, stop, freed budget)."""
        self.calls["watch"] += 1
        while (news := self.watch_news(worker_id, known_version)) is None:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        return news

    async def sync(self, request: SyncRequest) -> SyncReply:
        refs = [(g, item) for g, item in request.scored if not isinstance(item, TrajectoryGroup)]
        if refs:
            results = await asyncio.gather(*(item for _, item in refs), return_exceptions=True)
            scored = [(g, item) for g, item in request.scored if isinstance(item, TrajectoryGroup)]
            failed = []
            for (group_id, _), result in zip(refs, results):
                if isinstance(result, TrajectoryGroup):
                    scored.append((group_id, result))
                else:
                    log.warning("reward worker failed on group %s: %s", group_id, result)
                    failed.append(group_id)
            dropped = dict(request.dropped)
            if failed:
                dropped["reward_failed"] = [*dropped.get("reward_failed", []), *failed]
            request = SyncRequest(**{**request.__dict__, "scored": scored, "dropped": dropped})
        return super().sync(request)
