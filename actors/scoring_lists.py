"""The live reward, token-scoring (reference, teacher) and critic worker lists, with their generations, as the
controller hands them out.

The controller (actors/controller.py) mixes this in. The driver (cluster/supervisor.py) sets a new list after it
replaced a dead reward, reference or teacher worker or restarted the critic group; each set bumps a generation,
and a rollout worker whose `sync` request names an older generation gets the live list back in the reply (its
actors/score_router.py then sends its waiting groups to it).
"""

from actors.controller_messages import SyncReply, SyncRequest


class ScoringLists:
    """Reward workers under one generation; reference, teacher and critic workers under another."""

    def __init__(self) -> None:
        self.reward_workers: list = []
        self.reward_generation = 0
        self.model_workers: dict[str, list] = {}
        """Live reference, teacher and critic worker lists, set by the driver after it replaced one (see
        set_model_workers)."""
        self.model_generation = 0
        self.critic_actor_ids: set[str] = set()
        """Critic workers (PPO) chained after the reward workers: a group that met a dead one is handed back to be
        sent again after the driver restarted the critic group (dropped `critic_failed` on a worker's final call),
        never taken for a reward worker's."""

    def set_critic_actor_ids(self, actor_ids: list[str]) -> None:
        self.critic_actor_ids = set(actor_ids)

    def set_reward_workers(self, workers: list) -> int:
        """The live reward worker list after a replacement; every rollout worker gets it with its next `sync`
        reply. Returns the new generation."""
        self.calls["set_reward_workers"] += 1
        self.reward_workers = list(workers)
        self.reward_generation += 1
        return self.reward_generation

    def set_model_workers(self, role: str, workers: list) -> int:
        """The live list of `role` ("reference", "teacher" or "critic") after a replacement or a critic restart;
        every rollout worker gets it with its next `sync` reply. Returns the new generation."""
        self.calls["set_model_workers"] += 1
        self.model_workers[role] = list(workers)
        self.model_generation += 1
        return self.model_generation

    def _newer_lists(self, request: SyncRequest, reply: SyncReply) -> None:
        """Put on the reply the lists newer than the ones the request names."""
        if request.reward_generation < self.reward_generation:
            reply.reward_workers = (self.reward_generation, list(self.reward_workers))
        if request.model_generation < self.model_generation:
            reply.model_workers = (self.model_generation, {k: list(v) for k, v in self.model_workers.items()})
