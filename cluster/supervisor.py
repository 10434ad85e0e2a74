"""Supervision of the run's worker pools (cluster/pools.py): the driver's health checks, replacements and bounded
waits, as a loop over the pools.

The driver calls it instead of waiting on Ray directly. Each pool finds and replaces its own dead workers
(cluster/worker_pool.py): a rollout worker's run ref that ends early (cluster/rollout_pool.py, which also owns the
runs and the weight publishes that a dead engine can break), a reward or reference worker's ping, a critic rank
whose death restarts the critic group (cluster/critic_pool.py). Each wait is bounded by a `fault.*` setting named in
its error. Learner ranks are not replaced: cluster/learner_failure.py stops the run naming the lost rank.
"""

import logging
import time
from collections import Counter

import ray

from cluster.group_fetch import LOST, fetch_groups
from cluster.waits import get_within
from cluster.gateway_endpoints import session_totals, stall_message, waiting_line
from cluster.worker_pool import WorkerLost, WorkerPool
from protocols.config import RunConfig
from protocols.trajectory import TrajectoryGroup
from protocols.weight_announcement import WeightAnnouncement

__all__ = ["Supervisor", "WorkerLost"]

log = logging.getLogger(__name__)


class Supervisor:
    """Keeps every pool alive; the rollout pool's runs and publishes go through it."""

    def __init__(self, cfg: RunConfig, controller, pools: dict[str, WorkerPool]) -> None:
        self.cfg = cfg
        self.controller = controller
        self.pools = pools
        self.rollout = pools["rollout"]

    # --- rollout runs -----------------------------------------------------------------------------------------
    def start_runs(self) -> None:
        self.rollout.start_runs()

    def stop_runs(self) -> list[dict]:
        return self.rollout.stop_runs()

    def reports(self) -> list[dict]:
        """Every finished `run()` report of the job (all slots, all pauses)."""
        return list(self.rollout.finished_reports)

    @property
    def run_refs(self) -> list | None:
        return self.rollout.run_refs

    @property
    def rollout_ids(self) -> list[int]:
        """The controller's worker id of each rollout slot's current actor."""
        return list(self.rollout.ids.ids)

    def publish_weights(self, version: int) -> WeightAnnouncement:
        """The learner's publish of `version`, sent again on a new weight group if a dead engine broke it
        (RolloutPool.publish_weights)."""
        return self.rollout.publish_weights(version)

    @property
    def resent_publishes(self) -> int:
        return self.rollout.resent_publishes

    # --- health -----------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Replace every worker found dead since the last call (cheap: zero-timeout waits)."""
        for pool in self.pools.values():
            pool.check()

    def ensure_alive(self) -> None:
        """With generation stopped (before an evaluation): probe every worker and replace the dead ones."""
        for pool in self.pools.values():
            pool.ensure_alive()

    def wait_batch(self, version: int) -> tuple[list[TrajectoryGroup], float]:
        """The next training batch (a long poll on the controller, then its tokens fetched by ref), checking worker health every
        fault.health_check_s and logging what it waits for every fault.wait_log_s. Fails after
        fault.batch_timeout_s without one (time spent replacing workers excluded)."""
        fault = self.cfg.fault
        start = time.perf_counter()
        deadline = time.monotonic() + fault.batch_timeout_s
        next_line = time.monotonic() + fault.wait_log_s
        while True:
            before = sum(self.replaced.values())
            t0 = time.monotonic()
            self.check()
            if sum(self.replaced.values()) > before:
                deadline += time.monotonic() - t0  # a replacement's start does not count against the batch
            headers = ray.get(self.controller.wait_batch.remote(version, fault.health_check_s),
                              timeout=fault.health_check_s + fault.worker_start_timeout_s)
            if headers is not None:
                groups, lost = fetch_groups(headers, fault.worker_start_timeout_s)
                if lost:
                    ray.get(self.controller.count_lost.remote(LOST, lost), timeout=fault.worker_start_timeout_s)
                if groups:
                    return groups, time.perf_counter() - start
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(stall_message(self.cfg, version, *self._wait_state()))
            if now >= next_line:
                next_line = now + fault.wait_log_s
                log.warning(waiting_line(self.cfg, version, time.perf_counter() - start, *self._wait_state()))

    def _wait_state(self) -> tuple[dict, dict]:
        """The queue's counters and the session endpoints' (summed over the workers' last reports)."""
        limit = self.cfg.fault.call_timeout_s
        queue = get_within(self.controller.stats.remote(), limit, "the controller's stats", "fault.call_timeout_s")
        sessions = (session_totals(get_within(self.controller.get_worker_stats.remote(), limit, "the workers' reports",
                                              "fault.call_timeout_s"))
                    if self.cfg.gateway.enabled else {})
        return queue, sessions

    # --- counts -----------------------------------------------------------------------------------------------
    def workers(self, role: str) -> list:
        """The current actor handles of `role` (the critic's are its ranks)."""
        return self.pools[role].handles()

    @property
    def replaced(self) -> Counter[str]:
        """Replacements by role so far; a critic restart counts once, whatever the number of ranks."""
        return Counter({name: pool.replaced for name, pool in self.pools.items()})

    @property
    def restart_seconds(self) -> list[float]:
        """Seconds each replacement or critic restart took (detection to the new worker serving), by role."""
        return [s for pool in self.pools.values() for s in pool.restart_seconds]

    def metrics(self) -> dict[str, float]:
        return {**{f"fault/replaced_{name}": float(pool.replaced) for name, pool in self.pools.items()},
                **{f"fault/start_failures_{name}": float(pool.start_failures) for name, pool in self.pools.items()},
                "fault/resent_publishes": float(self.resent_publishes),
                "fault/first_load_failures": float(self.rollout.first_load_failures)}

    def replaced_counts(self) -> dict[str, int]:
        """Replacements by role over the run (summary.json's `replaced_workers`)."""
        return {name: pool.replaced for name, pool in self.pools.items()}
