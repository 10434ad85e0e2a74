"""The rollout controller: one Ray actor that owns the run's shared state.

It owns the prompt cursor, the admission budget that bounds staleness and memory, the leases of the groups in
flight, the replay queue, and the latest published weights. Its load grows with groups, not decode steps: a
rollout worker makes one `sync` call per batch of groups (hand over scored groups, ask for prompts, report
stats) and keeps one long poll (`watch`) open that returns when new weights are published, the run stops, or
admission budget it waits for is freed. The driver takes batches and publishes weights. The logic is plain
Python and serializable (`state_dict`), so the simulator and the checkpoints use the same class;
`ControllerActor` adds the asynchronous Ray entry points. Beside it: the messages (actors/controller_messages.py),
the prompt cursor (actors/prompt_cursor.py), the lease bookkeeping (actors/leases.py), the live scoring worker
lists (actors/scoring_lists.py) and the joining of the scoring tasks a worker hands over (actors/stream_join.py).

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
from actors.scoring_lists import ScoringLists
from actors.stream_join import ScorerFailed, resolve_all, sort_results
from gateway.sessions import SESSION_GROUP_PREFIX
from protocols.trajectory import TOKEN_SCORERS, Prompt, TrajectoryGroup
from protocols.weight_announcement import WeightAnnouncement

log = logging.getLogger(__name__)


class RolloutController(LeaseBook, ScoringLists):
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
                 from_data: bool = True) -> None:
        LeaseBook.__init__(self)
        ScoringLists.__init__(self)
        self.from_data = from_data
        """False under gateway.outside_only: no prompt is leased (no data set); every group is a session group."""
        self.cursor = PromptCursor(prompts, seed) if from_data else None
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
        self.rescored = 0
        self.rescored_scorer: Counter[str] = Counter({role: 0 for role in TOKEN_SCORERS})
        """Groups sent again after their worker of a token-scoring role (reference, teacher) died, by role."""
        self.rescored_critic = 0
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
        for group_id, group in request.scored:
            self._put(group)
        for reason, group_ids in request.dropped.items():
            self._drop(reason, group_ids)
        if request.stats is not None:
            self.worker_stats[request.worker_id] = request.stats
        self._waiting.pop(request.worker_id, None)
        self._woken.discard(request.worker_id)
        reply = SyncReply(stop=self.stopped, weights=self.latest_weights(request.version),
                          max_in_flight=self.fair_share)
        self._newer_lists(request, reply)
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
    def _put(self, group: TrajectoryGroup) -> bool:
        holder = self.leases.get(group.group_id)
        if not self._end_lease(group.group_id):
            return False
        if holder is not None:
            self.first_scored_at.setdefault(holder[0], time.time())
        if group.group_id.startswith(SESSION_GROUP_PREFIX):
            # a session endpoint's group (gateway/) is admitted when it arrives: its client, not the prompt
            # cursor, started it; so admitted = trained + dropped + queued holds for it too
            self.admitted += 1
        if self.lengths is not None:  # stale or not, its lengths say how long the prompt runs
            self.lengths.record(group)
        queued = self.queue.put(group)
        if queued:
            self._queue_grew()
        return queued

    def _queue_grew(self) -> None:
        """Hook: a batch may be ready (the Ray actor wakes the driver's `wait_batch`)."""

    def _drop(self, reason: str, group_ids: list[str]) -> None:
        count = sum(self._end_lease(g) for g in group_ids)
        self.queue.received += count
        self.queue.dropped[reason] += count

    # --- driver ------------------------------------------------------------------------------------------------
    def take_batch(self, learner_version: int) -> list[TrajectoryGroup] | None:
        self.calls["take_batch"] += 1
        return self._take_batch(learner_version)

    def _take_batch(self, learner_version: int) -> list[TrajectoryGroup] | None:
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
            "queue/rescored_reward_worker_died": self.rescored,
            **{f"queue/rescored_{role}_worker_died": n for role, n in self.rescored_scorer.items()},
            "queue/rescored_critic_failed": self.rescored_critic,
            "data/epoch": self.cursor.epoch if self.cursor is not None else 0,
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

    def state_dict(self) -> dict:
        return {
            "cursor": self.cursor.state_dict() if self.cursor is not None else None,
            "queue": self.queue.state_dict(),
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
    awaits the scored groups' object refs. A reward task whose worker died is handed back for re-scoring
    (`SyncReply.rescore`; dropped `reward_worker_died` on a worker's final call); any other failed reward task
    counts as dropped `reward_failed`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fatal_error = ""
        """Set when a reference worker's task raises (it did not die): the driver's next `wait_batch` raises it."""
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

    def _scorer_failed(self, group_id: str, err: ScorerFailed) -> None:
        """Stop the run with an error that names the worker and the settings: its forward raised (a dead reference
        or teacher worker is replaced instead, cluster/supervisor.py), and the same forward would raise again, so
        dropping every later group would stall the run without a word."""
        if not self.fatal_error:
            role = err.role
            log.error("%s worker failed on group %s: %s", role, group_id, err)
            # the config check names whatever else needs the role once it is off (e.g. the teacher's weight)
            off = ("set reference.num_workers=0 to score the reference inside the learner" if role == "reference"
                   else f"set {role}.num_workers=0 to train without it")
            self.fatal_error = (
                f"{err} (group {group_id}). A {role} worker that raises is not retried, so the run stops. If it ran "
                f"out of memory, lower {role}.max_tokens_per_micro_batch (0 scores in the learner's micro-batches: "
                f"learner.micro_batch_size or learner.max_tokens_per_micro_batch) or raise {role}.gpus; or {off}")
            self.stop()  # the workers stop generating groups that would only be dropped
        self._queue_grew()  # wake the driver's wait_batch, which raises it

    async def sync(self, request: SyncRequest) -> SyncReply:
        refs = [(g, item) for g, item in request.scored if not isinstance(item, TrajectoryGroup)]
        died, scorer_died, critic_died = [], {}, []
        if refs:
            results = await resolve_all([item for _, item in refs])
            joined = sort_results([g for g, _ in refs], results, self.critic_actor_ids)
            for group_id, err in joined.scorer_failures:
                self._scorer_failed(group_id, err)
            scored = [(g, item) for g, item in request.scored if isinstance(item, TrajectoryGroup)]
            scored += joined.scored
            failed, died = joined.failed, joined.died
            scorer_died, critic_died = joined.scorer_died, joined.critic_died
            if request.final:  # the worker stopped: nothing can be sent again
                lost = [("reward_worker_died", died), ("critic_failed", critic_died),
                        *((f"{role}_worker_died", ids) for role, ids in scorer_died.items())]
                for reason, group_ids in lost:
                    if group_ids:
                        failed.setdefault(reason, []).extend(group_ids)
                died, scorer_died, critic_died = [], {}, []
            dropped = dict(request.dropped)
            for reason, group_ids in failed.items():
                dropped[reason] = [*dropped.get(reason, []), *group_ids]
            request = SyncRequest(**{**request.__dict__, "scored": scored, "dropped": dropped})
        reply = super().sync(request)
        if died:
            self.rescored += len(died)
            reply.rescore = died
        for role, group_ids in scorer_died.items():
            self.rescored_scorer[role] += len(group_ids)
        reply.rescore_model = scorer_died
        if critic_died:
            self.rescored_critic += len(critic_died)
            reply.rescore_critic = critic_died
        return reply
