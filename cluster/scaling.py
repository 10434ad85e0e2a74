"""Resizing a running job's rollout pool: `relayrl scale RUN_DIR` requests (cluster/scale_requests.py), the rollout
autoscaler's decisions (cluster/autoscaler.py) and `Trainer.scale` from Python.

Neither direction pauses the learner. The driver calls `after_step` between two steps: it advances the resize under
way without waiting (a grow's engines join once they serve, a shrink's leaving workers stop once their groups in
flight came back: cluster/rollout_pool.py), then starts the next one, a `relayrl scale` request first, else the
autoscaler's decision. One resize at a time: a request made meanwhile waits in the inbox and the autoscaler holds
(reason `hold_resizing`), so what it measures next is the new size.
"""

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.autoscaler import Autoscaler, StepSignals
from cluster.placement import PlacementError, check_pool_sizes, nodes_from_ray, resource_request
from cluster.scale_requests import ScaleInbox, check_size
from cluster.worker_pool import WorkerLost
from protocols.config import RunConfig
from protocols.trajectory import TOKEN_SCORERS

log = logging.getLogger(__name__)


@dataclass
class Resize:
    """A grow or a shrink under way."""

    target: int
    started: float
    """time.perf_counter() when it was asked for."""
    version: int
    """The policy version when it was asked for (the steps trained meanwhile are the difference)."""
    request: dict | None
    """The `relayrl scale` request it answers; None for the autoscaler's."""


class Scaling:
    """The rollout pool's resizes for one run. `pools`: the run's pools by role (cluster/pools.py); `queue_stats`:
    the controller's counters now (queue/depth, queue/dropped_stale), which the autoscaler reads."""

    def __init__(self, cfg: RunConfig, pools: dict, queue_stats: Callable[[], dict]) -> None:
        self.cfg = cfg
        self.pools = pools
        self.pool = pools["rollout"]
        self.queue_stats = queue_stats
        self.nodes = nodes_from_ray
        """The cluster's nodes and their total resources, which `check_room` plans against."""
        self.autoscaler = Autoscaler(cfg.rollout.autoscale) if cfg.rollout.autoscale.enabled else None
        self.under_way: Resize | None = None
        self.requested_resources = False
        """A resize asked Ray's autoscaler for resources (cluster.autoscaling); withdrawn at `release`."""

    # --- from Python ------------------------------------------------------------------------------------------------
    def scale(self, rollout_workers: int) -> float:
        """Resize to `rollout_workers` and wait until it is done (a resize under way ends first). Returns the
        seconds it took. Raises ValueError, the pool unchanged, for a size that is not a whole number >= 1 or that
        the cluster can never hold (`check_room`); WorkerLost when new workers did not start (the pool keeps those
        that did)."""
        n = check_size("rollout", rollout_workers)
        start = time.perf_counter()
        if n > len(self.pool.workers):
            self.check_room(n)
        self.pool.resize(n, self.cfg.rollout.drain_timeout_s)
        return time.perf_counter() - start

    def check_room(self, rollout_workers: int) -> None:
        """Refuse a rollout pool the cluster's nodes can never hold beside the rest of the run (the launch plan with
        the new size, cluster/placement.py). With cluster.autoscaling, ask Ray's autoscaler for the whole run at
        the new size instead (`request_resources` replaces the run's previous request, so a shrink lets it remove
        nodes too); the new workers then start when the nodes arrive."""
        sizes = {"rollout": rollout_workers, **{name: len(self.pools[name].workers)
                                                for name in ("reward", *TOKEN_SCORERS) if name in self.pools}}
        if self.cfg.cluster.autoscaling:
            from ray.autoscaler.sdk import request_resources

            bundles = resource_request(self.cfg, sizes)
            request_resources(bundles=bundles)
            self.requested_resources = True
            log.warning("asked Ray's autoscaler for %d bundles (the run with %d rollout workers)", len(bundles),
                        rollout_workers)
            return
        try:
            check_pool_sizes(self.cfg, sizes, self.nodes())
        except PlacementError as err:
            raise ValueError(f"{rollout_workers} rollout workers are more than this cluster can ever hold beside "
                             f"the rest of the run: {err} If Ray's autoscaler adds nodes to this cluster, set "
                             "cluster.autoscaling=true") from None

    def release(self) -> None:
        """At shutdown: withdraw the request to Ray's autoscaler (it persists until replaced), so it can remove
        the nodes."""
        if self.requested_resources:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[])
            self.requested_resources = False

    # --- between steps ----------------------------------------------------------------------------------------------
    def after_step(self, metrics: dict, version: int, inbox: ScaleInbox) -> dict[str, float]:
        """Advance the resize under way; then, with none, start the newest `relayrl scale` request or else the
        autoscaler's decision on this step's `metrics`. Returns autoscale/* for metrics.jsonl (with the
        autoscaler on). Never waits for engines or drains; a resize that cannot be done is reported (the request's
        result, autoscale/failed) and the run goes on with the workers it has."""
        self._advance(inbox, version, wait=False)
        size = len(self.pool.workers)
        if self.under_way is None and (request := inbox.take()) is not None:
            self._start(request.get("rollout"), version, inbox, request)
        if self.autoscaler is None:
            return {}
        stats = self.queue_stats()
        signals = StepSignals(wait_s=metrics["time/wait_s"], step_s=metrics["time/step_s"],
                              queue_depth=int(stats["queue/depth"]), prompts_per_step=self.cfg.learner.prompts_per_step,
                              dropped_stale=int(stats.get("queue/dropped_stale", 0)))
        wanted, reason = size, "hold_resizing"
        if self.under_way is None:
            wanted, reason = self.autoscaler.decide(size, signals)
        out = {"autoscale/wait_frac": signals.wait_s / max(signals.step_s, 1e-9), f"autoscale/reason_{reason}": 1.0,
               "autoscale/change": float(wanted - size)}
        if wanted != size and not self._start(wanted, version, inbox, None):
            out["autoscale/failed"] = 1.0
        target = self.under_way.target if self.under_way is not None else len(self.pool.workers)
        return {**out, "autoscale/size": float(len(self.pool.workers)), "autoscale/target": float(target)}

    def settle(self, inbox: ScaleInbox, version: int) -> None:
        """At the run's end: wait for the resize under way, if any (its engines join or its drain ends), so the
        last evaluation runs on the pool that was asked for."""
        self._advance(inbox, version, wait=True)

    def _start(self, n, version: int, inbox: ScaleInbox, request: dict | None) -> bool:
        """Begin a resize to `n` (a grow's engines start, a shrink's workers leave the pool and drain). False, with
        the reason logged and written as the request's result, when it is refused or no new engine could start."""
        pool = self.pool
        try:
            n = check_size("rollout", n)
            if n > len(pool.workers):
                self.check_room(n)
                pool.begin_grow(n)
            elif n < len(pool.workers):
                pool.begin_drain(n, self.cfg.rollout.drain_timeout_s)
        except (ValueError, WorkerLost) as err:
            log.warning("resize of the rollout pool to %s (%s) refused: %s", n, _source(request), err)
            if request is not None:
                inbox.done(request, rollout=len(pool.workers), error=str(err))
            return False
        self.under_way = Resize(n, time.perf_counter(), version, request)
        if n == len(pool.workers):  # the size it has (a drain's workers are out already): answered if done
            self._advance(inbox, version, wait=False)
        return True

    def _advance(self, inbox: ScaleInbox, version: int, wait: bool) -> None:
        """Finish the resize under way if its engines serve or its drain ended (`wait`: block until then), and
        write the request's result: the pool's size, the seconds and the steps trained meanwhile."""
        resize = self.under_way
        if resize is None:
            return
        pool, error = self.pool, None
        try:
            if pool.joining is not None:
                if pool.finish_grow(wait=wait) is None:
                    return
            elif pool.leaving is not None and pool.finish_drain(wait=wait) is None:
                return
        except WorkerLost as err:
            error = str(err)
        self.under_way = None
        seconds, steps = time.perf_counter() - resize.started, version - resize.version
        log.warning("rollout pool now %d workers (%s: %.1f s, %d steps trained meanwhile)%s", len(pool.workers),
                    _source(resize.request), seconds, steps, f": {error}" if error else "")
        if resize.request is not None:
            result = {"error": error} if error else {"seconds": seconds, "steps_while_resizing": steps}
            inbox.done(resize.request, rollout=len(pool.workers), **result)


def _source(request: dict | None) -> str:
    return f"relayrl scale request {request['id']}" if request is not None else "the autoscaler"
