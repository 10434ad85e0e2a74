"""Supervision of the rollout, reward, reference and critic workers: the driver's health checks, replacements
and bounded waits.

The driver calls it instead of waiting on Ray directly. A rollout worker's `run()` only returns when the run
stops, so a run ref that finishes early is a dead worker: its leases are released through the controller
(counted as dropped `rollout_worker_died`), and a replacement starts in the same placement bundle under a new
controller id, loads the newest weights and takes work. Reward and reference workers are pinged; a dead one is
replaced in its bundle (a reference worker loads the frozen reference from the model folder again) and the live
list goes to the rollout workers through the controller, which hands back groups whose scoring died for
re-scoring (actors/controller.py). A dead critic rank restarts the whole critic group (cluster/critic_group.py
`restart`); groups that met a dead rank wait at their rollout worker for the new ranks. Each wait is bounded by
a `fault.*` setting named in its error. Learner ranks are not replaced: cluster/learner_failure.py stops the run
naming the lost rank.
"""

import logging
import time
from collections import Counter

import ray

from actors.reference_worker import ReferenceWorker
from actors.reward_worker import RewardWorker
from actors.rollout_worker import RolloutWorker
from cluster.ray_setup import reference_options, reward_options, rollout_options
from learner.weight_backends import weight_backend
from learner.weight_transport import BroadcastFailed
from protocols.config import RunConfig
from protocols.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """A worker died more often than fault.max_replacements allows, or its replacement did not start."""


ROLES = ("rollout", "reward", "reference", "critic")
"""Replacement counters (`fault/replaced_<role>`); a critic restart counts once, whatever the number of ranks."""


class Supervisor:
    """Keeps `rollout_workers`, `reward_workers` and `reference_workers` (the trainer's own lists, changed in
    place) and the critic group alive."""

    def __init__(self, cfg: RunConfig, placement, controller, model_path: str, learner,
                 rollout_workers: list, reward_workers: list, critic=None, reference_workers: list | None = None) -> None:
        """critic: PPO's CriticGroup or None. Replacement rollout workers get the current critic and reference
        workers."""
        self.cfg = cfg
        self.critic = critic
        self.reference_workers = reference_workers if reference_workers is not None else []
        self.placement = placement
        self.controller = controller
        self.model_path = model_path
        self.learner = learner
        self.rollout_workers = rollout_workers
        self.reward_workers = reward_workers
        self.rollout_ids = list(range(len(rollout_workers)))
        """The controller's worker id of each slot's current actor: a replacement takes slot + k * num_workers, so
        the dead one's id stays retired."""
        self.run_refs: list | None = None
        self.replaced: Counter[str] = Counter()
        self.finished_reports: list[dict] = []
        """Reports of `run()` calls that ended before the last one (paused for evaluation or a weight-group
        rejoin)."""
        self._pings: dict[tuple[str, int], object] = {}
        """(role, index) -> the ping in flight to that reward or reference worker."""
        self.restart_seconds: list[float] = []
        """Seconds each replacement or critic restart took (detection to the new worker serving), for reports."""
        self._last_check = 0.0
        self.resent_publishes = 0
        """Collective broadcasts sent again after a dead engine broke them (publish_weights)."""
        self._publishing: int | None = None
        """The version whose broadcast broke, while its dead engine is replaced (the new group receives it)."""
        self._resent: dict = {}
        """The announcement of the last send on a rejoined group: a broken publish returns it."""

    # --- rollout runs -----------------------------------------------------------------------------------------
    def start_runs(self) -> None:
        """Every rollout worker starts generating (the controller must not be stopped)."""
        self.run_refs = [w.run.remote() for w in self.rollout_workers]

    def stop_runs(self) -> list[dict]:
        """Stop generation and collect each worker's report, within fault.worker_start_timeout_s. A worker found
        dead here is released and replaced (not restarted): evaluation needs its engine."""
        ray.get(self.controller.stop.remote(), timeout=self.cfg.fault.worker_start_timeout_s)
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
                self._replace_rollout(index, err)
        self.finished_reports.extend(reports)
        return reports

    def reports(self) -> list[dict]:
        """Every finished `run()` report of the job (all slots, all pauses)."""
        return list(self.finished_reports)

    # --- health -----------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Replace every worker found dead since the last call (cheap: zero-timeout waits, one ping in flight per
        reward, reference and critic worker)."""
        self._last_check = time.monotonic()
        if self.critic is not None:  # a dead critic rank fails every group in the stream: restart the group
            lost = self.critic.dead_rank()
            if lost is not None:
                self._restart_critic(*lost)
        if self.run_refs is not None:
            live = [ref for ref in self.run_refs if ref is not None]
            ready, _ = ray.wait(live, num_returns=len(live), timeout=0)
            for ref in ready:
                if self.run_refs is None or ref not in self.run_refs:
                    # a replacement before it (weight_sync.type=collective) stopped every run, which replaced
                    # this dead worker too (stop_runs), and started new runs
                    continue
                index = self.run_refs.index(ref)
                try:
                    report = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self._replace_rollout(index, err)
                    continue
                # run() returns only at stop; the driver had not stopped it, so the loop must have been told to
                raise RuntimeError(f"rollout worker {index} left its loop before the run stopped: {report}")
        for role, workers, replace in (("reward", self.reward_workers, self._replace_reward),
                                       ("reference", self.reference_workers, self._replace_reference)):
            for index, worker in enumerate(workers):
                ping = self._pings.get((role, index))
                if ping is None:
                    self._pings[(role, index)] = worker.ping.remote()
                    continue
                if not ray.wait([ping], timeout=0)[0]:
                    continue  # busy scoring; asked again once it answers
                del self._pings[(role, index)]
                try:
                    ray.get(ping)
                except ray.exceptions.RayActorError as err:
                    replace(index, err)

    def ensure_alive(self) -> None:
        """With generation stopped (before an evaluation): ping every worker and replace the dead ones."""
        limit = self.cfg.fault.worker_start_timeout_s
        if self.critic is not None:
            lost = self.critic.dead_rank()
            if lost is not None:
                self._restart_critic(*lost)
        for role, workers, replace in (("rollout", self.rollout_workers, self._replace_rollout),
                                       ("reward", self.reward_workers, self._replace_reward),
                                       ("reference", self.reference_workers, self._replace_reference)):
            method = "get_version" if role == "rollout" else "ping"
            refs = [getattr(w, method).remote() for w in workers]
            ready, pending = ray.wait(refs, num_returns=len(refs), timeout=limit)
            if pending:
                raise TimeoutError(f"{len(pending)} {role} worker(s) did not answer within "
                                   f"fault.worker_start_timeout_s={limit}; raise it or look for a stuck worker")
            for index, ref in enumerate(refs):
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    replace(index, err)
        self._pings.clear()

    def wait_batch(self, version: int) -> tuple[list[TrajectoryGroup], float]:
        """The next training batch (a long poll on the controller), checking worker health every
        fault.health_check_s. Fails after fault.batch_timeout_s without one (time spent replacing workers
        excluded)."""
        fault = self.cfg.fault
        start = time.perf_counter()
        deadline = time.monotonic() + fault.batch_timeout_s
        while True:
            before = sum(self.replaced.values())
            t0 = time.monotonic()
            self.check()
            if sum(self.replaced.values()) > before:
                deadline += time.monotonic() - t0  # a replacement's start does not count against the batch
            groups = ray.get(self.controller.wait_batch.remote(version, fault.health_check_s),
                             timeout=fault.health_check_s + fault.worker_start_timeout_s)
            if groups is not None:
                return groups, time.perf_counter() - start
            if time.monotonic() > deadline:
                stats = ray.get(self.controller.stats.remote())
                raise TimeoutError(
                    f"no training batch for policy version {version} within fault.batch_timeout_s="
                    f"{fault.batch_timeout_s} (queue depth {stats['queue/depth']}, in flight "
                    f"{stats['queue/in_flight']}, every worker alive); raise it if generation is that slow")

    def publish_weights(self, version: int) -> dict:
        """The learner's publish of `version` (LearnerGroup.publish_weights). With a transport that forms a group
        (weight_sync.type=collective), a rollout engine that died since the last health check breaks the broadcast
        (its connections close) before the driver could notice; the dead worker is then replaced, which opens a
        new group with every live engine, and `version` goes out again on it (the learner already holds `version`'s
        weights, so that is what the new group receives, under that label). Raises the broadcast's error when no
        worker is found dead within weight_sync.timeout_s (a live engine that stopped receiving)."""
        try:
            return self.learner.publish_weights(version)
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
        before = self.replaced["rollout"]
        live = [ref for ref in self.run_refs or [] if ref is not None]
        if live:
            # A dead worker's run() ends with its actor; Ray may take a moment to say so after the socket closed.
            ray.wait(live, num_returns=1, timeout=self.cfg.weight_sync.timeout_s)
            self.check()
        else:
            self.ensure_alive()
        return self.replaced["rollout"] > before

    def workers(self, role: str) -> list:
        """The current actor handles of `role` (one of ROLES; the critic's are its ranks)."""
        if role == "critic":
            return list(self.critic.ranks) if self.critic is not None else []
        return list({"rollout": self.rollout_workers, "reward": self.reward_workers,
                     "reference": self.reference_workers}[role])

    def metrics(self) -> dict[str, float]:
        return {**{f"fault/replaced_{role}": float(self.replaced[role]) for role in ROLES},
                "fault/resent_publishes": float(self.resent_publishes)}

    def replaced_counts(self) -> dict[str, int]:
        """Replacements by role over the run (summary.json's `replaced_workers`)."""
        return {role: self.replaced[role] for role in ROLES}

    # --- replacement --------------------------------------------------------------------------------------------
    def _allow(self, role: str, index: int, err: BaseException) -> None:
        if self.replaced[role] >= self.cfg.fault.max_replacements:
            raise WorkerLost(
                f"{role} worker {index} died ({type(err).__name__}) after {self.replaced[role]} replacements of "
                f"{role} workers; fault.max_replacements={self.cfg.fault.max_replacements} allows no more. Raise "
                "it, or look at the worker's log (out of memory? a bad node?)") from err

    def _started(self, role: str, index: int, ref) -> None:
        limit = self.cfg.fault.worker_start_timeout_s
        try:
            ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError as err:
            raise WorkerLost(f"the replacement for {role} worker {index} did not start within "
                             f"fault.worker_start_timeout_s={limit}; raise it (an engine start can take minutes) "
                             "or check that its placement bundle's resources were freed") from err

    def _replace_rollout(self, index: int, err: BaseException) -> None:
        cfg = self.cfg
        old_id = self.rollout_ids[index]
        released = ray.get(self.controller.release_worker.remote(old_id, "rollout_worker_died"),
                           timeout=cfg.fault.worker_start_timeout_s)
        log.warning("rollout worker %d (id %d) died (%s); %d leased groups released; starting a replacement",
                    index, old_id, type(err).__name__, len(released))
        self._allow("rollout", index, err)
        new_id = old_id + len(self.rollout_workers)
        worker = ray.remote(RolloutWorker).options(**rollout_options(cfg, self.placement, index)).remote(
            cfg, new_id, self.model_path, self.controller, list(self.reward_workers),
            critic_workers=self.critic.workers if self.critic is not None else None,
            reference_workers=self.reference_workers)
        self._started("rollout", index, worker.get_version.remote())
        self.rollout_workers[index] = worker
        self.rollout_ids[index] = new_id
        self.replaced["rollout"] += 1
        if weight_backend(cfg).forms_group:
            self._rejoin_weight_group(index)
        else:
            latest = ray.get(self.controller.latest_weights.remote(0), timeout=cfg.fault.worker_start_timeout_s)
            if latest is not None:
                self._started("rollout", index, worker.load_weights.remote(*latest))
            if self.run_refs is not None:
                self.run_refs[index] = worker.run.remote()

    def _rejoin_weight_group(self, index: int) -> None:
        """A transport that forms a group (`collective`) has a fixed membership, so every engine and learner rank 0
        open a new one. Running workers take no calls, so generation pauses meanwhile. The learner then sends its
        weights on the new group, labelled with the version they are: the last announced one, or, when a broken
        broadcast brought us here, the version that broadcast carried (the learner has already stepped past the
        announced one; sending its weights under the older label would stamp the new engine's tokens wrongly)."""
        running = self.run_refs is not None
        if running:
            self.run_refs[index] = None
            self.stop_runs()
        self.learner.join_weight_group(self.rollout_workers)
        version = self._publishing
        if version is None:
            latest = ray.get(self.controller.latest_weights.remote(0), timeout=self.cfg.fault.worker_start_timeout_s)
            version = latest[0] if latest is not None else None
        if version is not None:
            self._resent = self.learner.publish_weights(version)
            self._started("rollout", index, self.rollout_workers[index].load_weights.remote(version, []))
        if running:
            ray.get(self.controller.resume.remote(), timeout=self.cfg.fault.worker_start_timeout_s)
            self.start_runs()

    def _replace_reward(self, index: int, err: BaseException) -> None:
        cfg = self.cfg
        log.warning("reward worker %d died (%s); starting a replacement", index, type(err).__name__)
        self._allow("reward", index, err)
        worker = ray.remote(RewardWorker).options(**reward_options(cfg, self.placement, index)).remote(
            cfg.reward, index)
        self._started("reward", index, worker.ping.remote())
        self.reward_workers[index] = worker
        self.replaced["reward"] += 1
        self._pings.pop(("reward", index), None)
        ray.get(self.controller.set_reward_workers.remote(list(self.reward_workers)),
                timeout=cfg.fault.worker_start_timeout_s)

    def _replace_reference(self, index: int, err: BaseException) -> None:
        """A replacement in the dead one's bundle, loading the frozen reference from the model folder (as at
        start: it never changes); the rollout workers get the live list, and the groups whose reference scoring
        died come back to them for re-scoring (at most fault.max_rescore_attempts times)."""
        cfg, start = self.cfg, time.monotonic()
        log.warning("reference worker %d died (%s); starting a replacement", index, type(err).__name__)
        self._allow("reference", index, err)
        worker = ray.remote(ReferenceWorker).options(**reference_options(cfg, self.placement, index)).remote(
            cfg, index, self.model_path)
        self._started("reference", index, worker.ping.remote())
        self.reference_workers[index] = worker
        self.replaced["reference"] += 1
        self._pings.pop(("reference", index), None)
        ray.get(self.controller.set_model_workers.remote("reference", list(self.reference_workers)),
                timeout=cfg.fault.worker_start_timeout_s)
        self.restart_seconds.append(time.monotonic() - start)

    def _restart_critic(self, index: int, err: BaseException) -> None:
        """Restart the whole critic group (cluster/critic_group.py `restart` says where its weights come from);
        the controller learns the new ranks' ids (a group that meets an old one is handed back for re-sending,
        not taken for a reward worker's failure) and the rollout workers get the new handles with their next
        `sync` reply."""
        cfg, start = self.cfg, time.monotonic()
        log.warning("critic worker %d of critic.num_workers=%d died (%s); restarting the critic group", index,
                    cfg.critic.num_workers, type(err).__name__)
        if self.replaced["critic"] >= cfg.fault.max_replacements:
            raise WorkerLost(
                f"critic worker {index} of critic.num_workers={cfg.critic.num_workers} died ({type(err).__name__}) "
                f"after {self.replaced['critic']} restarts of the critic group; fault.max_replacements="
                f"{cfg.fault.max_replacements} allows no more. Raise it, or look at the worker's log (out of memory: "
                "lower critic.micro_batch_size)") from err
        try:
            self.critic.restart(index)
        except TimeoutError as err:
            raise WorkerLost(f"the critic group did not restart after rank {index} died: {err}") from err
        self.replaced["critic"] += 1
        limit = cfg.fault.worker_start_timeout_s
        ray.get(self.controller.set_critic_actor_ids.remote(self.critic.actor_ids()), timeout=limit)
        ray.get(self.controller.set_model_workers.remote("critic", self.critic.workers), timeout=limit)
        self.restart_seconds.append(time.monotonic() - start)
