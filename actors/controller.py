"""The rollout controller: one Ray actor that owns the run's shared state.

It owns the prompt cursor, the admission budget that bounds staleness and memory, the replay queue, and the
latest published weights. Rollout workers ask it for prompts and for new weights, and hand it each group a
reward worker scored (as an object reference, so the data moves reward worker -> controller directly); the
driver takes batches from it and publishes weights through it. Everything here is plain
Python and serializable (`state_dict`), so the simulator and the checkpoints use the same class.
"""

import random

from actors.replay_queue import ReplayQueue
from protocols.trajectory import Prompt, TrajectoryGroup, WeightVersion


class PromptCursor:
    """Endless shuffled pass over the training prompts; the (epoch, index) pair is the data position."""

    def __init__(self, prompts: list[Prompt], seed: int) -> None:
        if not prompts:
            raise ValueError("the training set is empty after filtering; check data.train_path and data.max_prompt_tokens")
        self.prompts = prompts
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> Prompt:
        if self.index == len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._shuffled(self.epoch)
        prompt = self.prompts[self._order[self.index]]
        self.index += 1
        return prompt

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)


class RolloutController:
    """Admission, queue and weights. Admission rule (AReaL's staleness control, Fu et al. 2025, sec. 5.1):
    a worker holding policy version w may start a group only while

        admitted - dropped < (w + max_staleness + 1) * prompts_per_step

    so at most (max_staleness + 1) batches are queued or in flight: memory stays bounded and workers slow down by
    themselves. Groups that finish out of order can still arrive too old; the queue drops and counts those, which
    is what enforces the bound. A group is as old as its oldest token, so max_staleness must cover the longest
    responses: roughly k >= (longest / mean response length) * (engine slots / samples per batch) + 1.

    At max_staleness 0, each worker is granted at most its fair share ceil(prompts_per_step / num_workers) of
    groups in flight, so one fast-asking worker does not take the whole batch while the others idle.
    """

    def __init__(self, prompts: list[Prompt], prompts_per_step: int, max_staleness: int,
                 drop_zero_variance: bool, seed: int, num_workers: int = 1) -> None:
        self.cursor = PromptCursor(prompts, seed)
        self.prompts_per_step = prompts_per_step
        self.max_staleness = max_staleness
        self.num_workers = num_workers
        self.queue = ReplayQueue(max_staleness, drop_zero_variance)
        self.admitted = 0
        self.learner_version = 0
        self.stopped = False
        self._weights: tuple[int, list] = (0, [])
        self.published: list[WeightVersion] = []
        self.worker_stats: dict[int, dict] = {}

    # --- rollout workers -------------------------------------------------------------------------------------
    def budget(self, worker_version: int) -> int:
        dropped = sum(self.queue.dropped.values())
        limit = (worker_version + self.max_staleness + 1) * self.prompts_per_step
        return max(0, limit - (self.admitted - dropped))

    def acquire(self, worker_id: int, worker_version: int, max_groups: int,
                in_flight: int = 0) -> tuple[bool, list[tuple[str, Prompt]]]:
        """Up to `max_groups` prompts the worker may start now, as (group_id, prompt); first value: stop flag.
        `in_flight` is the number of groups the worker is still generating."""
        if self.stopped:
            return True, []
        if self.max_staleness == 0:
            fair_share = -(-self.prompts_per_step // self.num_workers)
            max_groups = min(max_groups, fair_share - in_flight)
        granted = []
        for _ in range(min(max_groups, self.budget(worker_version))):
            group_id = f"g{self.admitted}"
            self.admitted += 1
            granted.append((group_id, self.cursor.next()))
        return False, granted

    def poll(self, known_version: int) -> tuple[bool, tuple[int, list] | None]:
        """What a worker checks at each safe point, in one call: (stop flag, newer weights or None)."""
        return self.stopped, self.latest_weights(known_version)

    def latest_weights(self, known_version: int) -> tuple[int, list] | None:
        """(version, [weights ref]) when newer than `known_version`, else None."""
        version, refs = self._weights
        return (version, refs) if version > known_version else None

    # --- reward workers ----------------------------------------------------------------------------------------
    def put(self, group: TrajectoryGroup) -> bool:
        return self.queue.put(group)

    def report_dropped(self, reason: str, count: int = 1) -> None:
        """Groups a worker abandoned (for example its requests failed); they free admission budget."""
        self.queue.received += count
        self.queue.dropped[reason] += count

    # --- driver ------------------------------------------------------------------------------------------------
    def take_batch(self, learner_version: int) -> list[TrajectoryGroup] | None:
        self.learner_version = learner_version
        return self.queue.take(self.prompts_per_step, learner_version)

    def publish(self, weights: WeightVersion, refs: list) -> None:
        """Make `weights.version` the newest weights. `refs` is a list so Ray passes the object refs through
        unresolved (the tensors stay in the object store until a worker loads them)."""
        self._weights = (weights.version, refs)
        self.published.append(weights)
        self.learner_version = weights.version

    def report_worker_stats(self, worker_id: int, stats: dict) -> None:
        self.worker_stats[worker_id] = stats

    def stop(self) -> None:
        self.stopped = True

    def resume(self) -> None:
        self.stopped = False

    def stats(self) -> dict[str, float]:
        q = self.queue
        in_flight = self.admitted - q.received
        out = {
            "queue/depth": len(q),
            "queue/admitted": self.admitted,
            "queue/received": q.received,
            "queue/trained": q.trained,
            "queue/in_flight": in_flight,
            "data/epoch": self.cursor.epoch,
        }
        out.update({f"queue/dropped_{reason}": n for reason, n in q.dropped.items()})
        return out

    def get_worker_stats(self) -> dict[int, dict]:
        return dict(self.worker_stats)

    def state_dict(self) -> dict:
        return {
            "cursor": self.cursor.state_dict(),
            "queue": self.queue.state_dict(),
            "admitted": self.admitted,
            "learner_version": self.learner_version,
        }

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state["cursor"])
        self.queue.load_state_dict(state["queue"])
        self.admitted = state["admitted"]
        self.learner_version = state["learner_version"]
