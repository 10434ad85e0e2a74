"""The rollout pool: the vLLM engines (actors/rollout_worker.py), their `run()` loops, their controller ids and
their weights.

A rollout worker's `run()` only returns when the run stops, so a run ref that finishes early is a dead worker: its
leases are released through the controller (counted as dropped `rollout_worker_died`), and a replacement starts
in the same placement bundle under a new controller id (cluster/worker_pool.py `WorkerIds`), loads the newest
weights and takes work. With a transport that forms a group (weight_sync.type=collective) every engine and learner
rank 0 open a new group instead, and a broadcast that a dead engine broke is sent again on it.

Resizes never pause the learner; the driver advances them between steps (cluster/scaling.py). A grow starts new
engines (`begin_grow`) and adds them the same way once they serve (`finish_grow`). A shrink takes the leaving
workers out of the pool at once (`begin_drain`: they are granted nothing more) and stops them once their groups in
flight came back (`finish_drain`; past rollout.drain_timeout_s what is left is released as dropped
`rollout_worker_drained`).
"""

import logging
import time
from dataclasses import dataclass

import ray

from actors.rollout_worker import OUTBOX, RolloutWorker
from cluster.ray_setup import rollout_options
from cluster.scale_requests import check_size
from cluster.worker_pool import WorkerIds, WorkerLost, WorkerPool, resize_plan, start_failures
from protocols.config import RunConfig
from protocols.weight_announcement import WeightAnnouncement
from weights.backends import weight_backend
from weights.transport import BroadcastFailed

log = logging.getLogger(__name__)


@dataclass
class Joining:
    """Engines starting for a grow (`RolloutPool.begin_grow`), not in the pool yet: generation and training go on
    while they start."""

    target: int
    workers: list
    ids: list[int]
    """Their controller ids, reserved (WorkerIds.reserve)."""
    probes: list
    """Each one's first call (`get_version`): it answers once the engine serves."""
    started: float
    deadline: float
    """time.monotonic() past which those not serving count as failed (fault.worker_start_timeout_s)."""


@dataclass
class Leaving:
    """Workers draining for a shrink (`RolloutPool.begin_drain`), out of the pool already: generation and
    training go on while their groups in flight come back."""

    target: int
    workers: list
    ids: list[int]
    draining: dict
    """Controller id -> `run()` ref of those still holding groups (a ref that ends is a worker that died)."""
    died: list[int]
    started: float
    deadline: float
    """time.monotonic() past which their groups still out are released (rollout.drain_timeout_s)."""


class RolloutPool(WorkerPool):
    name = "rollout"
    probe = "get_version"
    placement_options = staticmethod(rollout_options)

    @classmethod
    def launch_size(cls, cfg: RunConfig) -> int:
        return cfg.rollout.num_workers

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.ids = WorkerIds(self.size)
        """The controller's worker id of each slot's current actor."""
        self.run_refs: list | None = None
        """Each slot's `run()` while generation runs (None for a slot being replaced); None while stopped."""
        self.finished_reports: list[dict] = []
        """Reports of `run()` calls that ended before the last one (paused for evaluation or a weight-group
        rejoin)."""
        self.resent_publishes = 0
        """Collective broadcasts sent again after a dead engine broke them (publish_weights)."""
        self._publishing: int | None = None
        """The version whose broadcast broke, while its dead engine is replaced (the new group receives it)."""
        self._resent: WeightAnnouncement | None = None
        """The announcement of the last send on a rejoined group: a broken publish returns it."""
        self.first_loads: dict = {}
        """The unwaited first weight load of each engine that joined or replaced one while generation ran (ref ->
        worker id), until `check` reads it."""
        self.first_load_failures = 0
        """First loads that raised without their engine dying (it loads again at its first sync)."""
        self.joining: Joining | None = None
        """A grow under way (begin_grow), until finish_grow adds its engines."""
        self.leaving: Leaving | None = None
        """A shrink under way (begin_drain), until finish_drain stops its workers."""

    def build(self, index: int, worker_id: int):
        """A rollout worker in slot `index`'s bundle under controller id `worker_id`: it knows only the controller."""
        ctx = self.ctx
        return ray.remote(**OUTBOX)(RolloutWorker).options(**self.actor_options(index)).remote(
            self.cfg, worker_id, ctx.model_path, ctx.controller)

    def start(self) -> None:
        self.workers.extend(self.build(i, self.ids.ids[i]) for i in range(self.size))

    def shutdown(self) -> None:
        if self.joining is not None:  # engines still starting for a grow
            for worker in self.joining.workers:
                ray.kill(worker)
            self.joining = None
        if self.leaving is not None:  # workers still draining for a shrink
            for worker in self.leaving.workers:
                ray.kill(worker)
            self.leaving = None
        super().shutdown()

    # --- runs -------------------------------------------------------------------------------------------------------
    def start_runs(self) -> None:
        """Every rollout worker starts generating (the controller must not be stopped)."""
        self.run_refs = [w.run.remote() for w in self.workers]

    def stop_runs(self) -> list[dict]:
        """Stop generation and collect each worker's report, within fault.worker_start_timeout_s. A worker found
        dead here is released and replaced (not restarted): evaluation needs its engine. A drain under way ends
        first: the stop would end the leaving workers' runs, which a drain reads as deaths."""
        if self.leaving is not None:
            self.finish_drain(wait=True)
        ray.get(self.ctx.controller.stop.remote(), timeout=self.cfg.fault.worker_start_timeout_s)
        refs, self.run_refs = self.run_refs or [], None
        limit = self.cfg.fault.worker_start_timeout_s
        live = [ref for ref in refs if ref is not None]
        ready, pending = ray.wait(live, num_returns=len(live), timeout=limit)
        if pending:
            raise TimeoutError(
                f"{len(pending)} rollout worker(s) did not stop within fault.worker_start_timeout_s={limit}; raise it "
                "if a weight load or a reward call at stop can take that long")
        reports = []
        for index, ref in enumerate(refs):
            if ref is None:  # a slot being replaced (collective weight group rejoin)
                continue
            try:
                reports.append(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                self.replace(index, err)
        self.finished_reports.extend(reports)
        return reports

    # --- health -----------------------------------------------------------------------------------------------------
    def check(self) -> None:
        """A run ref that finished while generation runs is a dead worker (zero-timeout wait): replace it. A first
        weight load that raised without its engine dying is counted and logged (the run's sync loads again)."""
        self._read_first_loads()
        if self.run_refs is None:
            return
        live = [ref for ref in self.run_refs if ref is not None]
        ready, _ = ray.wait(live, num_returns=len(live), timeout=0) if live else ([], [])
        for ref in ready:
            if self.run_refs is None or ref not in self.run_refs:
                # a replacement before it (weight_sync.type=collective) stopped every run, which replaced this dead
                # worker too (stop_runs), and started new runs
                continue
            index = self.run_refs.index(ref)
            try:
                report = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self.replace(index, err)
                continue
            # run() returns only at stop; the driver had not stopped it, so the loop must have been told to
            raise RuntimeError(f"rollout worker {index} left its loop before the run stopped: {report}")

    def _read_first_loads(self) -> None:
        if not self.first_loads:
            return
        ready, _ = ray.wait(list(self.first_loads), num_returns=len(self.first_loads), timeout=0)
        for ref in ready:
            worker_id = self.first_loads.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # its run ref ended too: the health check below replaces the engine
            except Exception as err:  # noqa: BLE001 - any error of the load, counted, never fatal here
                self.first_load_failures += 1
                log.warning("rollout worker id %d failed its first weight load (%s: %s); it loads again at its "
                            "first sync", worker_id, type(err).__name__, err)

    def replace(self, index: int, err: BaseException) -> None:
        cfg, start = self.cfg, time.monotonic()
        old_id = self.ids.ids[index]
        released = ray.get(self.ctx.controller.release_worker.remote(old_id, "rollout_worker_died"),
                           timeout=cfg.fault.worker_start_timeout_s)
        log.warning("rollout worker %d (id %d) died (%s); %d leased groups released; starting a replacement",
                    index, old_id, type(err).__name__, len(released))
        while True:
            self._allow(index, err)
            worker = self.build(index, self.ids.renew(index))
            self.replaced += 1
            try:
                self._started(index, worker.get_version.remote())
                break
            except ray.exceptions.RayActorError as died:  # it died starting: the same rule replaces it
                log.warning("the replacement for rollout worker %d died starting (%s); starting another", index,
                            type(died).__name__)
                err = died
        self.workers[index] = worker
        self._take_weights([index])
        self.restart_seconds.append(time.monotonic() - start)

    # --- weights ----------------------------------------------------------------------------------------------------
    def _take_weights(self, slots: list[int]) -> None:
        """New engines in `slots` (started, idle) load the newest weights, then, while generation runs, start their
        runs; with a group-forming transport every engine rejoins the weight group instead.

        While generation runs, the load and the run are both sent and not waited for: an actor runs its calls in
        the order they were sent, so the engine loads (and checks, with weight_sync.verify_every) before its first
        request, and the driver is not held between two steps meanwhile. A death during that load ends the run
        ref too, and the health check replaces the engine as any other dead one. Idle engines (no run) load here,
        within fault.worker_start_timeout_s."""
        if weight_backend(self.cfg).forms_group:
            self._rejoin_weight_group(slots)
            return
        latest = ray.get(self.ctx.controller.latest_weights.remote(0), timeout=self.cfg.fault.worker_start_timeout_s)
        loads = {slot: self.workers[slot].load_weights.remote(latest) for slot in slots} if latest is not None else {}
        if self.run_refs is not None:
            for slot in slots:
                self.run_refs[slot] = self.workers[slot].run.remote()
            self.first_loads.update({ref: self.ids.ids[slot] for slot, ref in loads.items()})
            return
        for slot, ref in loads.items():
            try:
                self._started(slot, ref)
            except ray.exceptions.RayActorError as err:  # it died loading: replaced, and the replacement loads
                self.replace(slot, err)

    def _rejoin_weight_group(self, slots: list[int]) -> None:
        """A transport that forms a group (`collective`) has a fixed membership, so every engine and learner rank 0
        open a new one (after a replacement, a new engine, or one that left; `slots`: the new engines). Running
        workers take no calls, so generation pauses meanwhile. The learner then sends its weights on the new
        group, labelled with the version they are: the last announced one, or, when a broken broadcast brought us
        here, the version that broadcast carried (the learner has already stepped past the announced one; sending
        its weights under the older label would stamp the new engine's tokens wrongly)."""
        running = self.run_refs is not None
        if running:
            for slot in slots:
                self.run_refs[slot] = None
            self.stop_runs()
        self.ctx.learner.join_weight_group(self.workers)
        version = self._publishing
        if version is None:
            latest = ray.get(self.ctx.controller.latest_weights.remote(0),
                             timeout=self.cfg.fault.worker_start_timeout_s)
            version = latest.version if latest is not None else None
        if version is not None:
            self._resent = self.ctx.learner.publish_weights(version)
            for slot in slots:
                self._started(slot, self.workers[slot].load_weights.remote(self._resent))
        if running:
            ray.get(self.ctx.controller.resume.remote(), timeout=self.cfg.fault.worker_start_timeout_s)
            self.start_runs()

    def publish_weights(self, version: int) -> WeightAnnouncement:
        """The learner's publish of `version` (LearnerGroup.publish_weights). With a transport that forms a group
        (weight_sync.type=collective), a rollout engine that died since the last health check breaks the broadcast
        (its connections close) before the driver could notice; the dead worker is then replaced, which opens a
        new group with every live engine, and `version` goes out again on it (the learner already holds `version`'s
        weights, so that is what the new group receives, under that label). Raises the broadcast's error when no
        worker is found dead within weight_sync.timeout_s (a live engine that stopped receiving)."""
        try:
            return self.ctx.learner.publish_weights(version)
        except BroadcastFailed as err:
            self._publishing = version
            try:
                if not self._replace_dead_engines():
                    raise
            finally:
                self._publishing = None
            log.warning("weight broadcast of version %d failed (%s); resent after replacing the dead rollout worker",
                        version, err)
        self.resent_publishes += 1
        return self._resent

    def _replace_dead_engines(self) -> bool:
        """Replace the rollout workers that died (each replacement rejoins the weight group); True if any did."""
        before = self.replaced
        live = [ref for ref in self.run_refs or [] if ref is not None]
        if live:
            # A dead worker's run() ends with its actor; Ray may take a moment to say so after the socket closed.
            ray.wait(live, num_returns=1, timeout=self.cfg.weight_sync.timeout_s)
            self.check()
        else:
            self.ensure_alive()
        return self.replaced > before

    # --- resize -----------------------------------------------------------------------------------------------------
    def resize(self, n: int, drain_timeout_s: float | None = None) -> None:
        """Resize to `n` engines and wait until it is done: a grow starts them and adds them once they serve
        (begin_grow, finish_grow), a shrink drains the last ones (begin_drain, finish_drain: `drain_timeout_s`).
        A resize under way is finished first. Raises WorkerLost, as finish_grow does, when new engines did not
        start (the run goes on)."""
        n = check_size("rollout", n)
        self.settle()
        if n > len(self.workers):
            self.begin_grow(n)
            self.finish_grow(wait=True)
        elif n < len(self.workers):
            self.begin_drain(n, drain_timeout_s)
            self.finish_drain(wait=True)

    def settle(self) -> None:
        """Wait for the grow or drain under way, if any, to end (a grow's WorkerLost propagates)."""
        if self.joining is not None:
            self.finish_grow(wait=True)
        if self.leaving is not None:
            self.finish_drain(wait=True)

    def begin_grow(self, n: int) -> None:
        """Start the engines that grow the pool to `n` (new controller ids; the placement's bundles while there
        are any left, then plain resources on any node with room) and return at once: the driver goes on
        stepping, and `finish_grow` adds them once they serve."""
        n = check_size("rollout", n)
        first = len(self.workers)
        if self.joining is not None or self.leaving is not None or n <= first:
            raise ValueError(f"begin_grow({n}) with {first} rollout workers"
                             + (" and a resize under way" if self.joining or self.leaving else "")
                             + ": a grow starts from a settled pool, to more workers than it has")
        plan = resize_plan(first, n, self.bundles)
        ids = [self.ids.reserve(slot) for slot in plan.start]
        workers = [self.build(slot, worker_id) for slot, worker_id in zip(plan.start, ids)]
        now = time.monotonic()
        self.joining = Joining(n, workers, ids, [getattr(w, self.probe).remote() for w in workers], now,
                               now + self.cfg.fault.worker_start_timeout_s)
        log.warning("rollout pool growing from %d to %d workers (ids %s; slots %s with plain resources, past the "
                    "placement's bundles): engines starting", first, n, ids,
                    sorted(set(plan.start) - set(plan.in_bundles)) or "none")

    def finish_grow(self, wait: bool = False) -> float | None:
        """Add the engines of the grow under way once each serves or failed: they load the newest weights (with
        a group-forming transport every engine rejoins the weight group) and, while generation runs, start their
        runs; the controller's worker count follows. Returns the grow's seconds, or None while some still start
        (`wait`: block until they serve or fault.worker_start_timeout_s passes) or when no grow is under way.
        Engines that did not start (an engine error, no room on the cluster in time) are killed, counted in
        `start_failures` and their ids retired; WorkerLost then names them, the pool keeping those that did."""
        joining = self.joining
        if joining is None:
            return None
        timeout = max(0.0, joining.deadline - time.monotonic()) if wait else 0
        _, pending = ray.wait(joining.probes, num_returns=len(joining.probes), timeout=timeout)
        if pending and time.monotonic() < joining.deadline:
            return None
        self.joining = None
        failed = start_failures(dict(enumerate(joining.probes)), pending, self.cfg.fault.worker_start_timeout_s)
        first = len(self.workers)
        for k, (worker, worker_id) in enumerate(zip(joining.workers, joining.ids)):
            if k in failed:
                ray.kill(worker)
                log.warning("new rollout worker id %d did not start: %s", worker_id, failed[k])
                self._tell_controller(self.ctx.controller.retire_worker.remote(worker_id))
                continue
            self.workers.append(worker)
            self.ids.ids.append(worker_id)
            if self.run_refs is not None:
                self.run_refs.append(None)
        self.start_failures += len(failed)
        started = list(range(first, len(self.workers)))
        if started:
            self._tell_controller(self.ctx.controller.set_num_workers.remote(len(self.workers)))
            self._take_weights(started)
        seconds = time.monotonic() - joining.started
        log.warning("rollout pool grew from %d to %d workers in %.1f s (ids %s)", first, len(self.workers), seconds,
                    self.ids.ids)
        if failed:
            raise WorkerLost(self._start_report("rollout", len(joining.workers), failed, len(self.workers)))
        return seconds

    def begin_drain(self, n: int, timeout_s: float | None = None) -> None:
        """Shrink to `n` workers: the last ones leave the pool at once (the controller grants them nothing more,
        their ids are retired) and return: the driver goes on stepping while their groups in flight finish and
        come back as usual; `finish_drain` ends the drain once none is out or `timeout_s` passed (the driver
        passes rollout.drain_timeout_s; fault.worker_start_timeout_s if None)."""
        n = check_size("rollout", n)
        first = len(self.workers)
        if self.joining is not None or self.leaving is not None or n >= first:
            raise ValueError(f"begin_drain({n}) with {first} rollout workers and a resize "
                             f"{'under way' if self.joining or self.leaving else 'to no fewer'}: a drain starts from "
                             "a settled pool, to fewer workers than it has")
        leaving = []
        for _ in range(first - n):
            run_ref = self.run_refs.pop() if self.run_refs is not None else None
            leaving.append((self.workers.pop(), self.ids.remove(), run_ref))
        ids = [worker_id for _, worker_id, _ in leaving]
        limit = self.cfg.fault.worker_start_timeout_s
        ray.get([self.ctx.controller.retire_worker.remote(i) for i in ids], timeout=limit)
        self._tell_controller(self.ctx.controller.set_num_workers.remote(n))
        now = time.monotonic()
        self.leaving = Leaving(n, [w for w, _, _ in leaving], ids, {i: ref for _, i, ref in leaving}, [], now,
                               now + (limit if timeout_s is None else timeout_s))
        log.warning("rollout pool shrinking from %d to %d workers: ids %s drain", first, n, ids)

    def finish_drain(self, wait: bool = False) -> float | None:
        """End the drain under way once the leaving workers hold no group or its deadline passed: the groups still
        out are released (dropped `rollout_worker_drained`, their admission budget freed) and the actors stop.
        A leaving worker that dies meanwhile (its `run()` ends: a drain sends no stop) has its groups released at
        once, as any dead worker's (dropped `rollout_worker_died`); it is not replaced. Returns the drain's seconds,
        or None while groups are still out (`wait`: block until the deadline) or when no drain is under way. The
        leaving workers' counters stay in the controller's worker stats, not in summary.json's reports."""
        leaving = self.leaving
        if leaving is None:
            return None
        controller, limit = self.ctx.controller, self.cfg.fault.worker_start_timeout_s
        while True:
            ended = [i for i, ref in leaving.draining.items() if ref is not None and ray.wait([ref], timeout=0)[0]]
            for worker_id in ended:
                released = ray.get(controller.release_worker.remote(worker_id, "rollout_worker_died"), timeout=limit)
                log.warning("rollout worker id %d died while draining; %d groups it held released", worker_id,
                            len(released))
                leaving.died.append(worker_id)
                del leaving.draining[worker_id]
            held = ray.get([controller.leases_of.remote(i) for i in leaving.draining], timeout=limit)
            leaving.draining = {i: ref for (i, ref), leases in zip(leaving.draining.items(), held) if leases}
            if not leaving.draining or time.monotonic() >= leaving.deadline:
                break
            if not wait:
                return None
            time.sleep(0.05)
        self.leaving = None
        released = ray.get([controller.release_worker.remote(i, "rollout_worker_drained") for i in leaving.ids
                            if i not in leaving.died], timeout=limit)
        for worker in leaving.workers:
            ray.kill(worker)
        seconds = time.monotonic() - leaving.started
        log.warning("rollout workers %s drained in %.1f s; %d groups still in flight released", leaving.ids, seconds,
                    sum(len(r) for r in released))
        if weight_backend(self.cfg).forms_group:  # the group's membership loses the leaving engines
            self._rejoin_weight_group([])
        return seconds
