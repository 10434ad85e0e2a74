"""Critic worker: a Ray actor holding one critic rank (learner/critic_rank.py). Besides training with its group
(driven by cluster/critic_group.py), it computes the values of every group on its way to the replay queue: the
controller's scoring stage sends it the group's ref beside the reward task (actors/scoring_stage.py), and the values
stay in the object store until the driver reads them.
"""

from learner.critic_rank import CriticRank
from protocols.training_batch import TrainingBatch
from protocols.trajectory import TrajectoryGroup


class CriticWorker(CriticRank):
    def values_rows(self, group: TrajectoryGroup) -> tuple[int, list[list[float]]]:
        """With two returns, as the scoring stage calls it: the critic version the values were computed after
        (small: the stage awaits it) and V(state before each response token), one row per trajectory (left in the
        object store until the learner reads them)."""
        batch = TrainingBatch.from_trajectories(group.trajectories)
        values, version = self.values(batch)
        return version, batch.per_sample_rows(values)

    def ping(self) -> int:
        return self.rank

    def actor_id(self) -> str:
        """This actor's id (hex), as a RayActorError names it when the actor dies."""
        import ray

        return ray.get_runtime_context().get_actor_id()
