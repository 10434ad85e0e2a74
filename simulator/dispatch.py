"""The simulated engines' waiting requests under length-aware dispatch (rollout.length_aware_dispatch), for
simulator/simulation.py: each holds `_Sequence`s whose `priority` is minus their group's expected length (from the
controller's `LengthHistory`, actors/length_history.py). Without length-aware dispatch an engine's waiting
requests are a plain deque (vLLM's first-come-first-served queue). The interface is the deque's subset the
simulator and its tool turns use: append, extend, insert, popleft, clear, len.
"""

import heapq
import math
from collections import deque


class GroupDispatch:
    """What the rollout worker does (actors/decode_loop.py, `max_num_seqs` set): it keeps its granted groups and
    hands the engine the one expected longest, whole, each time the engine's own first-come-first-served queue is
    empty, so that queue never holds more than one group and a group's samples start together. A continuation
    after a tool call joins the engine's queue (behind at most one group), or its head with continue_first."""

    def __init__(self) -> None:
        self._groups: list = []
        """Heap of (priority, arrival, the group's sequences) held at the worker."""
        self._order = 0
        self._engine: deque = deque()
        self._held = 0

    def extend(self, seqs) -> None:
        seqs = list(seqs)
        if seqs:
            self._order += 1
            heapq.heappush(self._groups, (seqs[0].priority, self._order, seqs))
            self._held += len(seqs)

    def append(self, seq) -> None:
        self._engine.append(seq)

    def insert(self, index: int, seq) -> None:
        self._engine.insert(index, seq)

    def popleft(self):
        if not self._engine:
            seqs = heapq.heappop(self._groups)[2]
            self._held -= len(seqs)
            self._engine.extend(seqs)
        return self._engine.popleft()

    def clear(self) -> None:
        self._groups.clear()
        self._engine.clear()
        self._held = 0

    def __len__(self) -> int:
        return len(self._engine) + self._held


class PriorityWaiting:
    """Study only (`SimulatorConfig.length_dispatch="engine"`, not a worker option): every request goes to the
    engine at once with its group's priority, under vLLM's `priority` scheduling policy, which admits the lowest
    (priority, arrival) first. A later group expected longer overtakes the unstarted samples of a group already
    started, so groups spread out in time and age. A continuation after a tool call (`insert`) goes first."""

    def __init__(self) -> None:
        self._heap: list = []
        self._order = 0

    def append(self, seq, priority: float | None = None) -> None:
        self._order += 1
        heapq.heappush(self._heap, (seq.priority if priority is None else priority, self._order, seq))

    def extend(self, seqs) -> None:
        for seq in seqs:
            self.append(seq)

    def insert(self, index: int, seq) -> None:
        self.append(seq, -math.inf)

    def popleft(self):
        return heapq.heappop(self._heap)[2]

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)
