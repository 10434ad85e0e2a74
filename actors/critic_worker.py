"""Critic worker: a Ray actor holding one critic rank (learner/critic_rank.py), driven by cluster/critic_group.py.
At each step its group scores the batch's values (the old values of the clipped value loss and GAE's baseline),
then trains on the batch's returns beside the policy's update.
"""

from learner.critic_rank import CriticRank


class CriticWorker(CriticRank):
    def ping(self) -> int:
        return self.rank
