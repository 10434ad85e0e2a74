"""The learner group: N DeepSpeed ranks as Ray actors, driven together.

Every call fans out to all ranks at once (DeepSpeed collectives need every rank), with the global batch split
into contiguous, equal shards. Rank 0 returns what only it holds (published weights, the saved model).
"""

import socket

import ray

from learner.learner_actor import LearnerRank
from learner.objective import LossNormalizer
from protocols.config import RunConfig
from cluster.placement import Placement, create_placement
from cluster.ray_setup import learner_options


def _rendezvous_address(_rank0, all_on_one_node: bool) -> tuple[str, int]:
    """Runs inside rank 0's actor: a free port on its own node (a port free on the driver's node may be taken
    there), and its address, or loopback when every rank shares the node."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ("127.0.0.1" if all_on_one_node else ray.util.get_node_ip_address()), port


def split_shards(samples: dict[str, list], num_ranks: int) -> list[dict[str, list]]:
    """Contiguous shards of per-sample lists whose sizes differ by at most one (equal for training batches,
    which the config makes divisible by the number of ranks)."""
    n = len(next(iter(samples.values())))
    bounds = [r * n // num_ranks for r in range(num_ranks + 1)]
    return [{k: v[bounds[r]:bounds[r + 1]] for k, v in samples.items()} for r in range(num_ranks)]


class LearnerGroup:
    def __init__(self, cfg: RunConfig, model_path: str, placement: Placement | None = None) -> None:
        """Start the ranks in the learner's placement group (the run's, or one of its own when None) and join
        them into one process group."""
        self.cfg = cfg
        self._own_placement = placement is None
        self.placement = placement or create_placement(cfg, roles=("learner",))
        n = cfg.learner.num_ranks
        self.ranks = [ray.remote(LearnerRank).options(**learner_options(cfg, self.placement, r)).remote(
            cfg, r, n, model_path) for r in range(n)]
        one_node = len(set(self.placement.bundle_nodes("learner"))) == 1
        # __ray_call__ runs the function inside rank 0's own process, so the port is free on rank 0's node.
        master, port = ray.get(self.ranks[0].__ray_call__.remote(_rendezvous_address, one_node))
        ray.get([rank.setup.remote(master, port) for rank in self.ranks])

    def train_step(self, samples: dict[str, list], normalizer: LossNormalizer) -> dict[str, float]:
        shards = split_shards(samples, len(self.ranks))
        results = ray.get([rank.train_step.remote(s, normalizer) for rank, s in zip(self.ranks, shards)])
        summed: dict[str, float] = {}
        for metrics in results:
            for key, value in metrics.items():
                summed[key] = max(summed.get(key, value), value) if key.endswith("_max") else summed.get(key, 0.0) + value
        return summed

    def ref_logprobs(self, samples: dict[str, list]) -> list[list[float]]:
        shards = split_shards(samples, len(self.ranks))
        parts = ray.get([rank.ref_logprobs.remote(s) for rank, s in zip(self.ranks, shards)])
        return [row for part in parts for row in part]

    def policy_logprobs(self, samples: dict[str, list]) -> list[list[float]]:
        shards = split_shards(samples, len(self.ranks))
        parts = ray.get([rank.policy_logprobs.remote(s) for rank, s in zip(self.ranks, shards)])
        return [row for part in parts for row in part]

    def publish_weights(self) -> dict:
        return ray.get([rank.publish_weights.remote() for rank in self.ranks])[0]

    def save_hf(self, folder: str) -> str:
        return ray.get([rank.save_hf.remote(folder) for rank in self.ranks])[0]

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
        if self._own_placement:
            self.placement.remove()
