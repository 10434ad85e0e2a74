"""A rollout worker's control decisions, without Ray or vLLM: when to call the controller, how many groups to
ask for, when to load newer weights, when to stop. `RolloutWorker.run` and the simulator (`simulator/simulation.py`)
both drive this class at each safe point, so the simulator's admission and control-plane figures are the workers'.

The worker keeps one long poll (`watch`) open for news (newer weights, stop, freed budget) and reads its answer
locally; it calls `sync` only when a batch of work is ready: at least `min_groups_per_request` scored groups to
hand over or free slots to fill, an idle engine, or a scored group held for `poll_interval_s`. `legacy` is the
old loop (poll the controller every decode step, ask whenever a slot is free, one call per scored group), kept
so the simulator can measure what it cost.
"""

import math
from dataclasses import dataclass

from actors.controller_messages import SyncReply, SyncRequest, WatchReply
from protocols.weight_announcement import WeightAnnouncement


@dataclass(frozen=True)
class PolicySettings:
    prompts_in_flight: int
    """Groups the worker keeps in its engine (rollout.prompts_in_flight)."""
    min_groups_per_request: int = 4
    """Free slots or scored groups that make a `sync` call worth it (rollout.min_groups_per_request)."""
    poll_interval_s: float = 0.2
    """Longest a scored group waits at the worker for others to share its call (rollout.poll_interval_s)."""
    partial_rollouts: bool = True
    """Load newer weights between decode steps with requests in flight (train.partial_rollouts and
    max_staleness > 0); otherwise drain the engine first."""
    legacy: bool = False
    """The per-decode-step loop the workers ran before, for measuring it."""
    leases: bool = True
    """Ask the controller for prompts. False under gateway.outside_only: the worker's groups are the sessions
    outside agents open on its endpoint."""
    report_every_s: float | None = None
    """Call `sync` at least this often, to hand over fresh counters (gateway.outside_only: the driver's waits
    report the endpoint's sessions from them); None: only when there is work to hand over or ask for."""

    @classmethod
    def from_run(cls, cfg) -> "PolicySettings":
        """From a `protocols.config.RunConfig`."""
        return cls(prompts_in_flight=cfg.rollout.prompts_in_flight,
                   min_groups_per_request=cfg.rollout.min_groups_per_request,
                   poll_interval_s=cfg.rollout.poll_interval_s,
                   partial_rollouts=cfg.train.partial_rollouts and cfg.train.max_staleness > 0,
                   leases=not cfg.gateway.outside_only,
                   report_every_s=cfg.fault.health_check_s if cfg.gateway.outside_only else None)


class WorkerPolicy:
    """State of one worker's control loop. `in_flight` arguments are the groups its engine is generating."""

    def __init__(self, settings: PolicySettings, worker_id: int, loaded_version: int = 0) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.loaded_version = loaded_version
        """The version of the weights in the worker's engine, as the worker reports it (`loaded`); the policy
        version itself is the driver's, and reaches the policy only as newer weights on offer."""
        self.newer: WeightAnnouncement | None = None
        self.stopped = False
        self.starved = False
        """The controller said the admission budget is spent; ask again when woken or after new weights."""
        self.woken = False
        self.synced = False
        self.scored: list[tuple[str, object]] = []
        """(group_id, scored group or its ObjectRef) ready to hand over."""
        self.held_since: float | None = None
        self.last_request_at: float | None = None
        self.dropped: dict[str, list[str]] = {}
        self.versions_seen = [loaded_version]
        self.max_in_flight = settings.prompts_in_flight
        """prompts_in_flight, or less where the controller caps it (the fair share at max_staleness 0)."""

    @property
    def threshold(self) -> int:
        return max(1, min(self.settings.min_groups_per_request, self.max_in_flight))

    # --- what the worker learned ---------------------------------------------------------------------------
    def on_watch(self, reply: WatchReply) -> None:
        self.stopped = self.stopped or reply.stop
        self._offer(reply.weights)
        if reply.budget_freed:
            self.starved, self.woken = False, True

    def on_scored(self, group_id: str, item: object, now: float) -> None:
        self.scored.append((group_id, item))
        if self.held_since is None:
            self.held_since = now

    def on_dropped(self, reason: str, group_ids: list[str]) -> None:
        if group_ids:
            self.dropped.setdefault(reason, []).extend(group_ids)

    def _offer(self, weights: WeightAnnouncement | None) -> None:
        if weights is None or weights.version <= self.loaded_version:
            return
        if self.newer is None or weights.version > self.newer.version:
            self.newer = weights

    # --- decisions -----------------------------------------------------------------------------------------
    def want(self, in_flight: int) -> int:
        """Groups to ask for now: free slots, but none while newer weights wait to be loaded."""
        if self.stopped or self.newer is not None or not self.settings.leases:
            return 0
        return max(0, self.max_in_flight - in_flight)

    def sync_due(self, now: float, in_flight: int) -> bool:
        """Whether this safe point calls the controller's `sync`."""
        s = self.settings
        if self.stopped:
            return False
        if s.legacy or not self.synced:
            return True
        want = self.want(in_flight)
        if want and (self.woken or (want >= self.threshold and not self.starved)):
            return True
        if self.scored and (len(self.scored) >= self.threshold or in_flight == 0
                            or now >= self.deadline() - 1e-9):  # (the simulator's clock has float noise)
            return True
        every = s.report_every_s
        if every is not None and now - (self.last_request_at or 0.0) >= every:
            return True
        return bool(self.dropped)

    def deadline(self) -> float | None:
        """When `sync_due` turns true with no other event: a held scored group's wait runs out."""
        if self.held_since is None or self.settings.legacy:
            return None
        return self.held_since + self.settings.poll_interval_s

    def request(self, now: float, in_flight: int, stats: dict | None = None) -> SyncRequest:
        """The `sync` call to make now; what it carries leaves the policy."""
        req = SyncRequest(worker_id=self.worker_id, version=self.loaded_version, in_flight=in_flight,
                          want=self.want(in_flight), scored=self.scored, dropped=self.dropped, stats=stats)
        self.scored, self.dropped, self.held_since = [], {}, None
        self.last_request_at = now
        self.synced, self.woken = True, False
        return req

    def on_reply(self, reply: SyncReply) -> list:
        """The groups to start."""
        self.stopped = self.stopped or reply.stop
        self._offer(reply.weights)
        self.starved = reply.starved
        if reply.max_in_flight is not None and not self.settings.legacy:  # the old loop asked regardless
            self.max_in_flight = max(1, min(self.settings.prompts_in_flight, reply.max_in_flight))
        return reply.granted

    def weights_to_load(self, in_flight: int) -> WeightAnnouncement | None:
        """Newer weights to load at this safe point: at once with partial rollouts, else once drained."""
        if self.stopped or self.newer is None:
            return None
        return self.newer if self.settings.partial_rollouts or in_flight == 0 else None

    def next_run(self) -> "WorkerPolicy":
        """A fresh control state for the worker's next `run()`, holding the weights this one holds."""
        fresh = WorkerPolicy(self.settings, self.worker_id, self.loaded_version)
        fresh.versions_seen = self.versions_seen
        return fresh

    def loaded(self, version: int) -> None:
        self.loaded_version = version
        self.versions_seen.append(version)
        if self.newer is not None and self.newer.version <= version:
            self.newer = None
        self.starved = False  # the budget grows with the worker's version

    def final_request(self, in_flight_ids: list[str], stats: dict | None = None) -> SyncRequest:
        """The last call after stop: scored groups still held, the aborted ones, final counters."""
        self.on_dropped("aborted_at_stop", list(in_flight_ids))
        return self.request(math.inf, 0, stats)


def legacy_calls(request: SyncRequest) -> dict[str, int]:
    """The controller calls the old loop made for the work of one `sync`: a poll, an acquire when it had free
    slots, one `put` per scored group and one `report_dropped` per reason."""
    calls = {"poll": 1, "acquire": int(request.want > 0), "put": len(request.scored),
             "report_dropped": len(request.dropped)}
    return {k: v for k, v in calls.items() if v}
