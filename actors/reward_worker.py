"""Reward worker: a Ray actor that scores trajectory groups coming from the rollout workers before they go to
the replay queue. A thin wrapper around `rewards.scorer.Scorer`, which holds the logic and is tested without
Ray. The driver creates `reward.num_workers` of them with `ray.remote(RewardWorker).options(num_cpus=...)`.
"""

from protocols.reward import RewardConfig
from protocols.trajectory import TrajectoryGroup
from rewards.scorer import Scorer


class RewardWorker:
    def __init__(self, cfg: RewardConfig, worker_index: int):
        self.worker_index = worker_index
        self.scorer = Scorer(cfg)

    def score_group(self, group: TrajectoryGroup) -> TrajectoryGroup:
        """Fills `reward` and `result` of each trajectory; a failed check gives reward 0, never an exception."""
        return self.scorer.score_group(group)

    def metrics(self) -> dict[str, float]:
        """`reward/*` counts since the last call (samples, errors by kind, mean verify time)."""
        return self.scorer.metrics()

    def ping(self) -> int:
        return self.worker_index

    def shutdown(self) -> None:
        self.scorer.close()
