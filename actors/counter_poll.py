"""Collects a worker group's counters for the run's log without ever blocking a step.

A reward or reference worker serves one call at a time, so a `counters` call waits behind the groups queued
before it. Each `read()` merges the answers that arrived since the last one and asks again only the workers that
answered, so counts arrive at most one logged step late and none is lost or counted twice.
"""

import logging
from collections.abc import Callable, Iterable, Mapping

import ray

from protocols.metrics import combine_metrics

log = logging.getLogger(__name__)


class CounterPoll:
    def __init__(self, workers: list, role: str,
                 to_metrics: Callable[[Iterable[Mapping[str, float]]], dict[str, float]]) -> None:
        """workers: the driver's own list, not a copy (the supervisor swaps replacements into it in place); each
        has a `counters()` method returning raw counts since its last call. to_metrics: raw counters of one or
        more workers -> named metrics (protocols/metrics.py)."""
        self.workers = workers
        self.role = role
        self.to_metrics = to_metrics
        self.pending: dict = {}  # ref -> worker index
        self.total: dict[str, float] = {}
        """Raw counters of every answer so far (the run's totals for summary.json)."""
        self.leaving: list = []
        """`counters()` refs of workers that left the pool (a resize): merged at the next read, then forgotten."""

    def read(self, wait_s: float = 0.0) -> dict[str, float]:
        """Metrics of the counters that arrived (waiting at most `wait_s` for outstanding ones)."""
        asked = set(self.pending.values())
        for i, worker in enumerate(self.workers):
            if i not in asked:
                self.pending[worker.counters.remote()] = i
        leaving, self.leaving = self.leaving, []
        if not self.pending and not leaving:
            return {}
        ready, _ = (ray.wait(list(self.pending), num_returns=len(self.pending), timeout=wait_s) if self.pending
                    else ([], []))
        arrived = []
        for ref in [*leaving, *ready]:
            index = self.pending.pop(ref, "(left the pool)")
            try:
                arrived.append(ray.get(ref))
            except ray.exceptions.RayError as err:
                # a dead worker's counts since its last answer are lost with it; the supervisor replaces it
                log.warning("%s worker %s's counters could not be read (%s); left out", self.role, index,
                            type(err).__name__)
        self.total = combine_metrics([self.total, *arrived])
        return self.to_metrics(arrived)

    def totals(self) -> dict[str, float]:
        """Metrics of every counter read over the run."""
        return self.to_metrics([self.total])

    def leave(self, workers: list) -> None:
        """Ask `workers`, which are leaving the pool (a resize), for their last counts: call before they are told to
        exit, so the answers come before the exit (the next `read` merges them)."""
        self.leaving += [worker.counters.remote() for worker in workers]
