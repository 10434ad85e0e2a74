"""The rollout controller: one Ray actor that owns the run's shared state.

It owns the prompt cursor, the admission budget that bounds staleness and memory, the leases of the groups in
flight, the replay queue, and the latest published weights. Its load grows with groups, not decode steps: a
rollout worker makes one `sync` call per batch of groups (hand over scored groups, ask for prompts, report
stats) and keeps one long poll (`watch`) open that returns when new weights are published, the run stops, or
admission budget it waits for is freed. The driver takes batches and publishes weights. The logic is plain
Python and serializable (`state_dict`), so the simulator and the checkpoints use the same class;
`ControllerActor` adds the asynchronous Ray entry points. Beside it: the messages (actors/controller_messages.py),
the prompt cursor (actors/prompt_cursor.py), the lease bookkeeping (actors/leases.py) and the scoring stage
(actors/scoring_stage.py), which owns the live scoring workers and scores every group a worker hands over.

Tokens never pass through here: a worker hands over a group header (protocols/group_header.py) holding the ref of
the group it put in the object store, and the queue holds headers.

The policy version is the driver's (cluster/trainer.py: a learner step makes the next one, and the learner stamps
it on the weights before they reach here). The controller keeps no counter of its own: it holds the newest
weights with their version (`publish`), and takes the driver's version with each `take_batch` / `wait_batch`.
"""

import asyncio
import logging
import time
from collections import Counter
from typing import Callable

from actors.controller_messages import SyncReply, SyncRequest, WatchReply
from actors.leases import LeaseBook
from actors.length_history import LengthHistory
from actors.prompt_cursor import PromptCursor
from actors.replay_queue import ReplayQueue
from actors.scoring_stage import REWARD, ScoringStage
from gateway.sessions import SESSION_GROUP_PREFIX
from protocols.group_header import GroupHeader
from protocols.trajectory import Prompt, TrajectoryGroup
from protocols.weight_announcement import WeightAnnouncement

log = logging.getLogger(__name__)


SCORING = -1
"""Lease holder of a group handed over and being scored: its worker's death no longer concerns it."""


class RolloutController(LeaseBook):
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
                 clock: Callable[[], float] = time.monotonic, length_aware: bool = False,
                 from_data: bool = True, max_rescore_attempts: int = 2, scoring_timeout_s: float = 1800.0,
                 source_weights: dict[str, float] | None = None) -> None:
        LeaseBook.__init__(self)
        self.stage = ScoringStage(max_rescore_attempts, scoring_timeout_s, self._scored, self._drop_one,
                                  self._fatal)
        """Scores every group handed over (actors/scoring_stage.py); the one owner of the live scoring workers."""
        self.fatal_error = ""
        """Set when a scoring worker raised without dying: the driver's next `wait_batch` raises it."""
        self.from_data = from_data
        """False under gateway.outside_only: no prompt is leased (no data set); every group is a session group."""
        self.cursor = PromptCursor(prompts, seed, source_weights) if from_data else None
        """`source_weights` ({data_source: weight}, data.tasks): the cursor draws a mixture's sources by weight."""
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.num_workers = num_workers
        self.queue = ReplayQueue(max_staleness, drop_zero_variance)
        self.admitted = 0
        self.stopped = False
        self._weights = WeightAnnouncement(version=0)
        """The newest published weights (refs included: the workers load them from it)."""
        self.published: list[WeightAnnouncement] = []
        """Every version published, without its refs (an old version's objects are not kept alive)."""
        self.worker_stats: dict[int, dict] = {}
        self.first_scored_at: dict[int, float] = {}
        """Worker id -> wall time (time.time(), comparable with a scale request's `requested_at`) its first scored
        group arrived: when a worker that joined a running job delivered its first samples."""
        self.clock = clock
        self.calls: Counter[str] = Counter()
        # starved worker -> (its version, groups it still wants), oldest first; and those whose watch should return
        self._waiting: dict[int, tuple[int, int]] = {}
        self._woken: set[int] = set()
        self._dropped_seen = 0
        self.lengths: LengthHistory | None = LengthHistory() if length_aware else None
        """With rollout.length_aware_dispatch: each prompt's expected response length, sent with its grants."""

    # --- rollout workers -------------------------------------------------------------------------------------
    def budget(self, worker_version: int) -> int:
        dropped = sum(self.queue.dropped.values())
        limit = (worker_version + self.max_staleness + 1) * self.prompts_per_step
        return max(0, limit - (self.admitted - dropped))

    @property
    def fair_share(self) -> int | None:
        """At max_staleness 0, the groups in flight one worker may hold: ceil(prompts_per_step / num_workers)."""
        return -(-self.prompts_per_step // self.num_workers) if self.max_staleness == 0 else None

    def _admit(self, worker_id: int, worker_version: int, max_groups: int, in_flight: int) -> list:
        """Up to `max_groups` prompts the worker may start now, as (group_id, prompt): groups to re-issue first,
        then new ones within the admission budget. `in_flight` is the number it is still generating."""
        if worker_id in self.lost_workers or not self.from_data:  # a dead worker's late call; outside-only
            return []
        if self.fair_share is not None:
            max_groups = min(max_groups, self.fair_share - in_flight)
        granted = []
        now = self.clock()
        while self.reissue and len(granted) < max_groups:
            group_id, prompt = self.reissue.pop(0)
            self._lease(group_id, prompt, worker_id, now)
            granted.append((group_id, prompt))
        max_groups -= len(granted)
        for _ in range(min(max_groups, self.budget(worker_version))):
            group_id, prompt = f"g{self.admitted}", self.cursor.next()
            self.admitted += 1
            self._lease(group_id, prompt, worker_id, now)
            granted.append((group_id, prompt))
        return granted

    def sync(self, request: SyncRequest) -> SyncReply:
        """One worker call: take its scored and abandoned groups, record its stats, then answer with the stop
        flag, newer weights, or the groups it may start. Scored groups go first, so budget their drops free is
        granted in the same call."""
        self.calls["sync"] += 1
        headers = [item if isinstance(item, GroupHeader) else GroupHeader.of(item, rewarded=True)
                   for _, item in request.scored]
        in_outbox = [h for h in headers if h.ref is None and h.group is None]
        if in_outbox:
            self._take_from_outbox(request.outbox, in_outbox)
        self.stage.submit(*[h for h in headers if self._hand_over(h)])  # one batch: a task per role, not per group
        for reason, group_ids in request.dropped.items():
            self._drop(reason, group_ids)
        if request.stats is not None:
            self.worker_stats[request.worker_id] = request.stats
        self._waiting.pop(request.worker_id, None)
        self._woken.discard(request.worker_id)
        reply = SyncReply(stop=self.stopped, weights=self.latest_weights(request.version),
                          max_in_flight=self.fair_share)
        if not reply.stop and reply.weights is None and request.want > 0:
            reply.granted = self._admit(request.worker_id, request.version, request.want, request.in_flight)
            if self.lengths is not None:
                reply.expected_lengths = {g: self.lengths.expected(p) for g, p in reply.granted}
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

    def latest_weights(self, known_version: int) -> WeightAnnouncement | None:
        """The newest announcement when newer than `known_version`, else None."""
        return self._weights if self._weights.version > known_version else None

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
    def release_worker(self, worker_id: int, reason: str = "worker_lost") -> list[str]:
        """Drop every group leased to a lost worker (counted as dropped `reason`), freeing its admission budget.
        The worker id is retired: a call it still had in flight is granted nothing."""
        self.calls["release_worker"] += 1
        group_ids = self._release_leases(worker_id)
        self.queue.received += len(group_ids)
        self.queue.dropped[reason] += len(group_ids)
        self._waiting.pop(worker_id, None)
        self._wake_waiters()
        return group_ids

    def retire_worker(self, worker_id: int) -> list[str]:
        """A worker leaving the pool (cluster/rollout_pool.py `resize`): it is granted nothing more, and the groups
        it holds still come back as usual (`release_worker` ends those left). Returns them."""
        self.calls["retire_worker"] += 1
        self.lost_workers.add(worker_id)
        self._waiting.pop(worker_id, None)
        return self.leases_of(worker_id)

    def set_num_workers(self, num_workers: int) -> None:
        """The rollout pool's size after a resize: the fair share at max_staleness 0 divides among them."""
        self.num_workers = num_workers

    # --- scored and dropped groups ------------------------------------------------------------------------
    def _take_from_outbox(self, outbox, headers: list[GroupHeader]) -> None:
        """Set each header's ref to its group, taken from the worker's outbox (ControllerActor: by a task)."""
        raise ValueError(f"groups {[h.group_id for h in headers]} came without their tokens: the plain controller "
                         "takes groups inline (a TrajectoryGroup, or GroupHeader.of(group))")

    # --- scoring workers ----------------------------------------------------------------------------------
    def set_scoring_workers(self, workers: dict[str, list]) -> None:
        """Every scoring role's live list at start (role -> handles: reward, reference, teacher)."""
        self.calls["set_scoring_workers"] += 1
        for role, handles in workers.items():
            self.stage.set_workers(role, handles)

    def set_reward_workers(self, workers: list) -> int:
        """The live reward worker list after a replacement. Returns its generation."""
        self.calls["set_reward_workers"] += 1
        return self.stage.set_workers(REWARD, workers)

    def set_model_workers(self, role: str, workers: list) -> int:
        """The live list of `role` (reference, teacher) after a replacement."""
        self.calls["set_model_workers"] += 1
        return self.stage.set_workers(role, workers)

    # --- scored and dropped groups ------------------------------------------------------------------------
    def _hand_over(self, header: GroupHeader) -> bool:
        """A worker's finished group: it leaves the worker's lease (the stage holds it while it is scored), then
        goes to the queue, or, returning True, to the stage when a role still has to score it. A group whose
        lease was released (its worker was declared lost) is ignored."""
        group_id = header.group_id
        if group_id in self.released:
            self._end_lease(group_id)  # counts the late arrival
            return False
        holder = self.leases.get(group_id)
        if holder is not None:
            self.first_scored_at.setdefault(holder[0], time.time())
            self.leases[group_id] = (SCORING, holder[1])
        if group_id.startswith(SESSION_GROUP_PREFIX):
            # a session endpoint's group (gateway/) is admitted when it arrives: its client, not the prompt
            # cursor, started it; so admitted = trained + dropped + queued + in flight holds for it too
            self.admitted += 1
        if header.rewarded and not any(self.stage.roles_for(header)):
            self._scored(header)
            return False
        return True

    def _scored(self, header: GroupHeader) -> bool:
        """A group every role scored: into the queue (or dropped and counted by it)."""
        if not self._end_lease(header.group_id):
            return False
        if self.lengths is not None:  # stale or not, its lengths say how long the prompt runs
            self.lengths.record(header)
        queued = self.queue.put(header)
        if queued:
            self._queue_grew()
        self._wake_waiters()
        return queued

    def _drop_one(self, reason: str, group_id: str) -> None:
        self._drop(reason, [group_id])
        self._wake_waiters()

    def _fatal(self, message: str) -> None:
        """Stop the run with `message` (a scoring worker raised): the workers stop generating groups that would
        only be dropped, and the driver's next `wait_batch` raises it."""
        if not self.fatal_error:
            log.error("%s", message)
            self.fatal_error = message
            self.stop()
        self._queue_grew()

    def count_lost(self, reason: str, group_ids: list[str]) -> None:
        """Groups taken for training whose tokens could not be fetched (their object store's node died):
        counted dropped `reason` instead of trained."""
        self.calls["count_lost"] += 1
        self.queue.trained -= len(group_ids)
        self.queue.dropped[reason] += len(group_ids)
        self._wake_waiters()

    def _queue_grew(self) -> None:
        """Hook: a batch may be ready (the Ray actor wakes the driver's `wait_batch`)."""

    def _drop(self, reason: str, group_ids: list[str]) -> None:
        count = sum(self._end_lease(g) for g in group_ids)
        self.queue.received += count
        self.queue.dropped[reason] += count

    # --- driver ------------------------------------------------------------------------------------------------
    def take_batch(self, learner_version: int) -> list[GroupHeader] | None:
        self.calls["take_batch"] += 1
        return self._take_batch(learner_version)

    def _take_batch(self, learner_version: int) -> list[GroupHeader] | None:
        batch = self.queue.take(self.prompts_per_step, learner_version)
        self._wake_waiters()  # stale drops free budget
        return batch

    def publish(self, weights: WeightAnnouncement) -> None:
        """Make `weights.version` the newest weights. Its refs sit inside the record, so Ray passes the object refs
        through unresolved (the tensors stay in the object store until a worker loads them)."""
        self.calls["publish"] += 1
        self._weights = weights
        self.published.append(weights.model_copy(update={"refs": []}))
        # every worker's watch returns with the new weights; after loading them it asks again
        self._waiting.clear()
        self._woken.clear()
        self._notify()

    def stop(self) -> None:
        self.stopped = True
        self._notify()

    def resume(self) -> None:
        self.stopped = False
        self._notify()

    def stats(self, generated: bool = False) -> dict[str, float]:
        """The queue's counters; with `generated`, also the lengths of every sample received since the last such
        call (the driver asks once per logged step)."""
        q = self.queue
        in_flight = self.admitted - q.received
        out = {
            "queue/depth": len(q),
            "queue/admitted": self.admitted,
            "queue/received": q.received,
            "queue/trained": q.trained,
            "queue/in_flight": in_flight,
            "queue/leased": len(self.leases),
            "queue/reissue_pending": len(self.reissue),
            "queue/late_after_release": self.late_after_release,
            "queue/scoring": len(self.stage.pending),
            **{f"queue/{name}": n for name, n in self.stage.counts.items()},
            "data/epoch": self.cursor.epoch if self.cursor is not None else 0,
            **(self.cursor.metrics() if self.cursor is not None else {}),
        }
        out.update({f"queue/dropped_{reason}": n for reason, n in q.dropped.items()})
        if q.drop_zero_variance:
            out["queue/zero_variance_rewarded"] = q.zero_variance_rewarded
        out.update({f"control/calls_{method}": n for method, n in self.calls.items()})
        if generated:
            out.update(q.generated_metrics())
        return out

    def get_worker_stats(self) -> dict[int, dict]:
        return dict(self.worker_stats)

    def get_first_scored_at(self) -> dict[int, float]:
        """`first_scored_at`: worker id -> wall time of its first scored group."""
        return dict(self.first_scored_at)

    def state_dict(self, groups: list[TrajectoryGroup] | None = None) -> dict:
        """`groups`: the queued groups assembled, when they are in the object store (ControllerActor)."""
        return {
            "cursor": self.cursor.state_dict() if self.cursor is not None else None,
            "queue": self.queue.state_dict(groups),
            "admitted": self.admitted,
            **self._leases_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        if self.cursor is not None and state["cursor"] is not None:
            self.cursor.load_state_dict(state["cursor"])
        self.queue.load_state_dict(state["queue"])
        self.admitted = state["admitted"]
        # (checkpoints before this one also hold "learner_version": the driver publishes its own after loading)
        self._load_leases_state(state)
        self._dropped_seen = sum(self.queue.dropped.values())


class ControllerActor(RolloutController):
    """The controller hosted as an asynchronous Ray actor (`ray.remote(ControllerActor)`). Its plain methods run
    on the actor's event loop one at a time, as before; `watch` waits there without holding it, and `sync`
    runs the scoring stage's tasks."""

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

    async def wait_batch(self, learner_version: int, timeout_s: float = 1.0) -> list[GroupHeader] | None:
        """Long poll for `take_batch`: the next batch once it is complete, or None after `timeout_s`, so the
        driver makes about one call per step instead of polling."""
        self.calls["wait_batch"] += 1
        if self.fatal_error:
            raise RuntimeError(self.fatal_error)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (batch := self._take_batch(learner_version)) is None:
            if self._grew is None:
                self._grew = asyncio.Event()
            try:
                await asyncio.wait_for(self._grew.wait(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                if self.fatal_error:
                    raise RuntimeError(self.fatal_error) from None
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
        # on the event loop, where the scoring stage's tasks run
        return super().sync(request)

    def _take_from_outbox(self, outbox, headers: list[GroupHeader]) -> None:
        # one task for the call's groups, one return each: this actor owns them, in the worker's object store
        refs = outbox.take_groups.options(num_returns=len(headers), concurrency_group="outbox").remote(
            [h.group_id for h in headers])
        for header, ref in zip(headers, refs if len(headers) > 1 else [refs]):
            header.ref = ref

    async def state_dict(self) -> dict:
        """The plain state, with every queued group fetched by ref and assembled (the checkpoint holds tokens;
        the queue does not)."""
        headers = self.queue.headers()
        groups = await asyncio.gather(*(assembled(h) for h in headers))
        return {**super().state_dict(groups=list(groups))}


async def assembled(header: GroupHeader) -> TrajectoryGroup:
    """The group of `header` as the learner reads it, fetched by its refs (or inline)."""
    if header.ref is None:
        return header.inline()
    group, *rows = await asyncio.gather(header.ref, *header.scores.values())
    return header.assemble(group, dict(zip(header.scores, rows)))
