"""Worker pools: one role's Ray actors (rollout engines, reward, reference and critic workers) started, checked,
replaced after a death and resized by one object, so that the supervisor (cluster/supervisor.py) is a loop over
pools and a new role is one pool class in the registry (cluster/pools.py).

A pool's slots are the indices of its `workers` list: a replacement takes the dead actor's slot and placement
bundle, a resize adds or removes slots at the end. The list is changed in place, so the trainer's own name for it
stays valid. What differs by role is the subclass's: how one actor is built and probed, and what the controller
is told after a change (`ScoringPool` for workers that score groups on their way to the queue; the rollout pool
in cluster/rollout_pool.py; the critic group in cluster/critic_pool.py). The bookkeeping that needs no Ray
(`WorkerIds`, `resize_plan`, `drop_slots`, `check_replacement_allowed`; `check_size` in
cluster/scale_requests.py) is plain functions and classes, tested without it.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray

from actors.counter_poll import CounterPoll
from cluster.placement import Placement
from cluster.scale_requests import check_size
from protocols.config import RunConfig

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A worker died more often than fault.max_replacements allows, or its replacement did not start."""


# --- bookkeeping without Ray -----------------------------------------------------------------------------------
def check_replacement_allowed(role: str, index: int, replaced: int, max_replacements: int,
                              err: BaseException) -> None:
    """Raise WorkerLost when `role` worker `index` died after `replaced` replacements and
    fault.max_replacements=`max_replacements` allows no more."""
    if replaced >= max_replacements:
        raise WorkerLost(
            f"{role} worker {index} died ({type(err).__name__}) after {replaced} replacements of {role} workers; "
            f"fault.max_replacements={max_replacements} allows no more. Raise it, or look at the worker's log (out "
            "of memory? a bad node?)") from err


class WorkerIds:
    """The controller's worker id of each rollout slot. A replacement or a new slot takes the smallest id of the
    form slot + k * stride (stride: the launch size) never used before, so a dead or drained worker's id stays
    retired (the controller grants it nothing more) and a fixed-size pool's replacements take slot + num_workers,
    slot + 2 * num_workers, ..."""

    def __init__(self, num_slots: int) -> None:
        self.ids = list(range(num_slots))
        self.stride = max(num_slots, 1)
        self.used = set(self.ids)

    def _fresh(self, slot: int) -> int:
        worker_id = slot
        while worker_id in self.used:
            worker_id += self.stride
        self.used.add(worker_id)
        return worker_id

    def renew(self, slot: int) -> int:
        """A new id for `slot` (its actor is being replaced)."""
        self.ids[slot] = self._fresh(slot)
        return self.ids[slot]

    def add(self) -> int:
        """The id of a new slot at the end."""
        self.ids.append(self._fresh(len(self.ids)))
        return self.ids[-1]

    def reserve(self, slot: int) -> int:
        """A fresh id for `slot`, a slot past the end whose worker is still starting; `ids.append` adds it once
        the worker joins (never given again either way)."""
        return self._fresh(slot)

    def remove(self) -> int:
        """The id of the last slot, which leaves."""
        return self.ids.pop()

    def discard(self, slot: int) -> int:
        """The id of `slot`, whose new worker never started: the slots after it move down one, and the id is
        never given again (its worker may have reached the controller before it was killed)."""
        return self.ids.pop(slot)


def drop_slots(items: list, slots) -> None:
    """Remove the entries of `slots` from a by-slot list in place (later slots move down): the new workers of a
    resize that did not start, from every list the pool keeps by slot."""
    for slot in sorted(set(slots), reverse=True):
        del items[slot]


@dataclass(frozen=True)
class ResizePlan:
    start: list[int]
    """Slots to start, in order."""
    in_bundles: list[int]
    """Those of `start` that have a bundle of the run's placement; the others take plain resource options."""
    leave: list[int]
    """Slots to drain and stop, highest first."""


def resize_plan(current: int, target: int, bundles: int) -> ResizePlan:
    """From `current` slots to `target`, where the role's placement reserved `bundles` (its launch size)."""
    start = list(range(current, target))
    return ResizePlan(start=start, in_bundles=[s for s in start if s < bundles],
                      leave=list(range(current - 1, target - 1, -1)))


def start_failures(probes: dict, pending: list, limit: float) -> dict:
    """{key: why} of the new workers whose first call (`probes`, by key) is still `pending` after `limit` seconds
    or raised: the reason a pool logs, counts and reports."""
    failed = {}
    for key, ref in probes.items():
        if ref in pending:
            failed[key] = (f"not serving within fault.worker_start_timeout_s={limit} s: the cluster had no room for "
                           "it (see `ray status`), or its engine start takes longer (raise the timeout)")
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayError as err:
            failed[key] = f"its start failed: {type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}"
    return failed


# --- the pools ---------------------------------------------------------------------------------------------------
@dataclass
class PoolContext:
    """What every pool of one run shares."""

    cfg: RunConfig
    controller: Any
    placement: Placement | None
    """The run's placement groups (None: plain resource options, as tests start single actors)."""
    model_path: str
    learner: Any = None
    """The LearnerGroup, once started (the rollout pool opens weight groups and publishes through it)."""
    pools: dict[str, "WorkerPool"] = field(default_factory=dict)
    """Every pool of the run by role, in start order."""

    def scoring_lists(self) -> dict[str, list]:
        """Role -> live handles of every pool whose workers score groups on their way to the queue (reward,
        reference, teacher, critic), as the controller's scoring stage takes them."""
        return {p.name: p.handles() for p in self.pools.values() if p.scores}


class WorkerPool:
    """One role's actors. Subclasses give `name`, `launch_size`, `start`, `replace` and `resize`; the health
    checks here ping every worker (one ping in flight each), which fits workers that serve one call at a time."""

    name: ClassVar[str] = ""
    """The role: `fault/replaced_<name>`, summary.json's `replaced_workers`, the errors."""
    probe: ClassVar[str] = "ping"
    """The method `ensure_alive` calls on every worker."""
    scores: ClassVar[bool] = False
    """Its workers score groups on their way to the queue: their live handles go to the controller's scoring
    stage under the role's name (actors/scoring_stage.py)."""
    token_scorer: ClassVar[bool] = False
    """A frozen model that scores every response token in the stream (protocols.trajectory.TOKEN_SCORERS)."""
    counter_metrics: ClassVar[Callable | None] = None
    """protocols/metrics.py function of the workers' raw `counters()`, for a role that keeps some."""
    placement_options: ClassVar[Callable[[RunConfig, Placement | None, int], dict] | None] = None
    """cluster/ray_setup.py options function of the role (placement None: plain resources)."""

    @classmethod
    def launch_size(cls, cfg: RunConfig) -> int:
        raise NotImplementedError

    @classmethod
    def precheck(cls, cfg: RunConfig, model_path: str) -> None:
        """Refuse settings this role cannot run, before any actor starts (nothing to check by default)."""

    def __init__(self, ctx: PoolContext) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.size = self.launch_size(ctx.cfg)
        self.workers: list = []
        self.replaced = 0
        """Replacements over the run (a critic group restart counts once)."""
        self.restart_seconds: list[float] = []
        """Seconds each replacement took, from detection to the new worker serving."""
        self.start_failures = 0
        """New workers of a resize that did not start (an error in their start, or no resources in time)."""
        self._pings: dict[int, Any] = {}
        """Slot -> the ping in flight to its worker (`check`)."""
        plan = ctx.placement.plan if ctx.placement is not None else None
        self.bundles = len(plan.role(self.name).bundles) if plan and any(
            r.role == self.name for r in plan.roles) else 0
        """Bundles the run's placement reserved for this role; slots beyond them (grown) take plain resources."""
        metrics = type(self).counter_metrics
        self.counters = CounterPoll(self.workers, self.name, metrics) if metrics is not None else None

    def actor_options(self, index: int) -> dict:
        """Ray options of slot `index`: its bundle, or plain resources past the placement's bundles."""
        placement = self.ctx.placement if index < self.bundles else None
        return type(self).placement_options(self.cfg, placement, index)

    # --- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the role's actors at their launch size without waiting for them (the trainer starts every pool,
        then the learner, then waits: the starts overlap)."""
        raise NotImplementedError

    def ready(self) -> None:
        """Wait for the started actors to serve, within fault.worker_start_timeout_s."""
        self._wait_serving(list(range(len(self.workers))), "the")

    def handles(self) -> list:
        """The live actor handles, by slot."""
        return list(self.workers)

    def writers(self) -> list:
        """Actors that write the run folder (checkpoints, the final model): checked to share it at start."""
        return []

    def shutdown(self) -> None:
        for worker in self.handles():
            ray.kill(worker)

    # --- health ---------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Replace every worker found dead since the last call, without blocking: a ping in flight per worker,
        looked at with a zero timeout (a busy worker answers later)."""
        for index, worker in enumerate(self.workers):
            ping = self._pings.get(index)
            if ping is None:
                self._pings[index] = worker.ping.remote()
                continue
            if not ray.wait([ping], timeout=0)[0]:
                continue  # busy; asked again once it answers
            del self._pings[index]
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError as err:
                self.replace(index, err)

    def ensure_alive(self) -> None:
        """With generation stopped (before an evaluation): probe every worker and replace the dead ones."""
        if self.workers:
            limit = self.cfg.fault.worker_start_timeout_s
            refs = [getattr(w, self.probe).remote() for w in self.workers]
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=limit)
            if pending:
                raise TimeoutError(f"{len(pending)} {self.name} worker(s) did not answer within "
                                   f"fault.worker_start_timeout_s={limit}; raise it or look for a stuck worker")
            for index, ref in enumerate(refs):
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self.replace(index, err)
        self._pings.clear()

    def replace(self, index: int, err: BaseException) -> None:
        """Replace the dead worker of slot `index` (bounded by fault.max_replacements)."""
        raise NotImplementedError

    def resize(self, n: int) -> None:
        """Grow or shrink the pool to `n` workers (the driver calls it between steps)."""
        raise NotImplementedError

    # --- training beside the policy (nothing to train by default) ------------------------------------------------
    @property
    def trains(self) -> bool:
        """Whether this role trains beside the policy each step; the driver calls `score_batch`, `start_update`
        and `finish_update` only on the pools that do."""
        return False

    def score_batch(self, batch):
        """The step's batch with what this role adds before the advantages (PPO's critic: its values)."""
        raise NotImplementedError(f"the {type(self).__name__} pool trains nothing (its `trains` is False)")

    def start_update(self, batch):
        """Launch this role's own update on the step's prepared batch, to run while the policy's does (PPO's critic
        fits the batch's `returns`); returns what `finish_update` needs."""
        raise NotImplementedError(f"the {type(self).__name__} pool trains nothing (its `trains` is False)")

    def finish_update(self, started) -> dict[str, float]:
        """Wait for the update `start_update` launched; its metrics."""
        raise NotImplementedError(f"the {type(self).__name__} pool trains nothing (its `trains` is False)")

    # --- checkpoints and the end of the run (nothing to keep by default) -------------------------------------------
    def save_state(self, folder) -> dict:
        """Write this role's state into checkpoint `folder`; entries for its state.json."""
        return {}

    def load_state(self, folder, state: dict) -> None:
        """Load what `save_state` wrote (`state`: the checkpoint's state.json)."""

    def save_final(self, run_dir) -> None:
        """Write what the run leaves besides the final policy."""

    # --- counters -------------------------------------------------------------------------------------------------
    def read_counters(self, wait_s: float = 0.0) -> dict[str, float]:
        """The workers' counters that arrived since the last read (actors/counter_poll.py), as metrics."""
        return self.counters.read(wait_s) if self.counters is not None else {}

    def counter_totals(self) -> dict[str, float] | None:
        """The counters over the run, for summary.json (None: the role keeps none, or is off)."""
        return self.counters.totals() if self.counters is not None and self.workers else None

    # --- helpers --------------------------------------------------------------------------------------------------
    def _allow(self, index: int, err: BaseException) -> None:
        check_replacement_allowed(self.name, index, self.replaced, self.cfg.fault.max_replacements, err)

    def _started(self, index: int, ref, which: str = "the replacement for") -> Any:
        """The result of `ref` (a new actor's first call), within fault.worker_start_timeout_s."""
        limit = self.cfg.fault.worker_start_timeout_s
        try:
            return ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError as err:
            raise WorkerLost(f"{which} {self.name} worker {index} did not start within "
                             f"fault.worker_start_timeout_s={limit}; raise it (an engine start can take minutes) "
                             "or check that its placement bundle's resources were freed") from err

    def _wait_serving(self, slots: list[int], which: str) -> None:
        """Wait for the workers of `slots` to answer their probe, together, within fault.worker_start_timeout_s."""
        limit = self.cfg.fault.worker_start_timeout_s
        refs = [getattr(self.workers[s], self.probe).remote() for s in slots]
        try:
            ray.get(refs, timeout=limit)
        except ray.exceptions.GetTimeoutError as err:
            raise WorkerLost(f"{which} {self.name} workers {slots} did not start within "
                             f"fault.worker_start_timeout_s={limit}; raise it (an engine start can take minutes) "
                             "or check that the cluster has their resources") from err

    def _start_new(self, slots: list[int]) -> dict[int, str]:
        """Wait for the new workers of `slots` to answer their probe, together, within fault.worker_start_timeout_s.
        Those that did not (their start raised, or the cluster had no room for them by then) are killed, counted
        in `start_failures` and removed from `workers` (later slots move down; see `drop_slots`). Returns
        {slot: why} of the failed ones; the pool then holds exactly the workers that serve."""
        limit = self.cfg.fault.worker_start_timeout_s
        refs = {s: getattr(self.workers[s], self.probe).remote() for s in slots}
        _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=limit)
        failed = start_failures(refs, pending, limit)
        for slot in failed:
            ray.kill(self.workers[slot])
            log.warning("new %s worker in slot %d did not start: %s", self.name, slot, failed[slot])
        drop_slots(self.workers, failed)
        self.start_failures += len(failed)
        return failed

    @staticmethod
    def _start_report(name: str, wanted: int, failed: dict[int, str], size: int) -> str:
        why = "; ".join(sorted(set(failed.values())))
        return f"{len(failed)} of {wanted} new {name} worker(s) did not start ({why}); the pool goes on with {size}"

    def _tell_controller(self, ref) -> None:
        ray.get(ref, timeout=self.cfg.fault.worker_start_timeout_s)


class ScoringPool(WorkerPool):
    """Workers that score groups on their way to the queue, each on its own (reward, reference; a teacher): the
    controller's scoring stage sends to the live list the driver sets. A subclass names the actor class, its
    constructor arguments and the controller call that sets the live list."""

    scores = True
    actor: ClassVar[type]

    def actor_args(self, index: int) -> tuple:
        raise NotImplementedError

    def announce(self):
        """The controller call (its ref) that makes the current `workers` the live list."""
        raise NotImplementedError

    def build(self, index: int):
        return ray.remote(type(self).actor).options(**self.actor_options(index)).remote(*self.actor_args(index))

    def start(self) -> None:
        self.workers.extend(self.build(i) for i in range(self.size))

    def replace(self, index: int, err: BaseException) -> None:
        """A new worker in the dead one's slot (and bundle); the controller's scoring stage takes the live list, and
        the groups whose scoring died are sent to it again (at most fault.max_rescore_attempts times,
        actors/scoring_stage.py)."""
        start = time.monotonic()
        log.warning("%s worker %d died (%s); starting a replacement", self.name, index, type(err).__name__)
        self._allow(index, err)
        worker = self.build(index)
        self._started(index, worker.ping.remote())
        self.workers[index] = worker
        self.replaced += 1
        self._pings.pop(index, None)
        self._tell_controller(self.announce())
        self.restart_seconds.append(time.monotonic() - start)

    def resize(self, n: int) -> None:
        """Grow: new workers start (past the placement's bundles with plain resources) and join the live list once
        they answer. Shrink: the last workers leave the live list first, then finish the calls already queued at
        them and exit; a group sent to one before its rollout worker learned the new list meets a dead worker and
        is re-scored elsewhere, as after a death. New workers that do not start are killed and counted
        (`start_failures`); the others join, and WorkerLost then says which failed and the size the pool has."""
        n = check_size(self.name, n)
        if not self.workers:
            raise ValueError(f"{self.name} pool resize to {n}: a role that is off ({self.name}.num_workers=0) cannot "
                             "be turned on in a running job; start the job with it")
        plan = resize_plan(len(self.workers), n, self.bundles)
        first = len(self.workers)
        self.workers.extend(self.build(i) for i in plan.start)
        failed = self._start_new(plan.start) if plan.start else {}
        leaving = [self.workers.pop() for _ in plan.leave]
        for slot in plan.leave:
            self._pings.pop(slot, None)
        self._tell_controller(self.announce())
        if leaving:
            if self.counters is not None:  # their last counts, asked before the exit so they answer first
                self.counters.leave(leaving)
            exits = [w.__ray_terminate__.remote() for w in leaving]
            ray.wait(exits, num_returns=len(exits), timeout=self.cfg.fault.worker_start_timeout_s)
            for worker in leaving:
                ray.kill(worker)
        log.warning("%s pool resized from %d to %d workers (%s with plain resources, past the placement's bundles)",
                    self.name, first, len(self.workers), sorted(set(plan.start) - set(plan.in_bundles)) or "none")
        if failed:
            raise WorkerLost(self._start_report(self.name, len(plan.start), failed, len(self.workers)))
