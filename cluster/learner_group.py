"""The learner group: N DeepSpeed ranks as Ray actors, driven together.

Every call fans out to all ranks at once (DeepSpeed collectives need every rank), with the global batch split
into contiguous, equal shards. Rank 0 returns what only it holds (published weights, the saved model).
"""

import socket

import ray

from learner.learner_actor import LearnerRank
from learner.objective import LossNormalizer
from protocols.config import RunConfig
from cluster.ray_setup import learner_options


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_shards(samples: dict[str, list], num_ranks: int) -> list[dict[str, list]]:
    """Contiguous shards of per-sample lists whose sizes differ by at most one (equal for training batches,
    which the config makes divisible by the number of ranks)."""
    n = len(next(iter(samples.values())))
    bounds = [r * n // num_ranks for r in range(num_ranks + 1)]
    return [{k: v[bounds[r]:bounds[r + 1]] for k, v in samples.items()} for r in range(num_ranks)]


class LearnerGroup:
    def __init__(self, cfg: RunConfig, model_path: str) -> None:
        self.cfg = cfg
        n = cfg.learner.num_ranks
        remote = ray.remote(LearnerRank).options(**learner_options(cfg))
        self.ranks = [remote.remote(cfg, r, n, model_path) for r in range(n)]
        master = ray.get(self.ranks[0].node_address.remote())
        # The port is picked on the driver's node; on a multi-node cluster rank 0 may live elsewhere, so the
        # port is only a good guess there. Ray's own collective setup is the alternative if this ever collides.
        port = _free_port()
        ray.get([rank.setup.remote(master if cfg.cluster.address else "127.0.0.1", port) for rank in self.ranks])

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

    def publish_weights(self, version: int = 0) -> dict:
        return ray.get([rank.publish_weights.remote(version) for rank in self.ranks])[0]

    def join_weight_group(self, engines: list) -> dict:
        """weight_sync.type=collective: learner rank 0 (group rank 0) and one receiver per rollout engine (ranks
        1..N) open the weight group together. An engine with tensor parallelism joins once: its receiver loads
        the full checkpoint-format tensors into every engine rank, and vLLM's weight loaders shard them.
        Returns the join info. Raises with the settings to change if a member cannot join in time."""
        ws = self.cfg.weight_sync
        backend = ws.backend if ws.backend != "auto" else ("nccl" if self.cfg.cluster.use_gpus else "gloo")
        host, port = ray.get(self.ranks[0].weight_group_address.remote())
        info = {"host": host, "port": port, "world_size": 1 + len(engines), "backend": backend,
                "timeout_s": ws.timeout_s, "bucket_bytes": ws.bucket_mb * 2**20,
                "metas": ray.get(self.ranks[0].weight_metas.remote())}
        refs = [self.ranks[0].join_weight_group.remote(info)]
        refs += [engine.join_weight_group.remote({**info, "rank": 1 + i}) for i, engine in enumerate(engines)]
        # Each member times out on its own after timeout_s; the margin covers actor start and the store.
        ray.get(refs, timeout=ws.timeout_s + 60)
        return info

    def save_hf(self, folder: str) -> str:
        return ray.get([rank.save_hf.remote(folder) for rank in self.ranks])[0]

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
