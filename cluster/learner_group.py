"""The learner group: N DeepSpeed ranks as Ray actors, driven together.

Every call fans out to all ranks at once (DeepSpeed collectives need every rank), with the global batch split
into shards of about equal token counts (learner/micro_batches.py) and every rank told the same number of
micro-batches. Rank 0 returns what only it holds (published weights, the saved model). With
learner.sequence_parallel_size = sp > 1 the batch is split over the num_ranks / sp data-parallel groups: ranks
r of one group (r // sp equal) get the same shard, and scores come back from the group's first rank.
"""

import socket

import ray

from learner.learner_actor import LearnerRank, plan_micro_batches, sample_tokens
from learner.micro_batches import plan_ranks
from learner.objective import LossNormalizer
from protocols.config import RunConfig
from cluster.ray_setup import learner_options


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def balanced_shards(samples: dict[str, list], cfg: RunConfig, num_ranks: int) -> tuple[list[list[int]], list[dict], int]:
    """(sample indices per data-parallel group, the per-group shards, the micro-batch count every rank runs).
    A group is sequence_parallel_size ranks (one rank without SP). Groups get about equal token loads; with
    sample-count micro-batches they also get equal sample counts."""
    num_groups = num_ranks // cfg.learner.sequence_parallel_size
    parts = plan_ranks(sample_tokens(samples), num_groups, cfg.learner.max_tokens_per_micro_batch)
    shards = [{k: [v[i] for i in idx] for k, v in samples.items()} for idx in parts]
    count = max(len(plan_micro_batches(shard, cfg, None)) for shard in shards)
    return parts, shards, count


def merge_rows(parts: list[list[int]], results: list[list]) -> list:
    """Per-rank result rows back in the global batch's order."""
    out: list = [None] * sum(len(p) for p in parts)
    for idx, rows in zip(parts, results):
        for i, row in zip(idx, rows):
            out[i] = row
    return out


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

    def _group_shards(self, shards: list[dict]) -> list[tuple]:
        """(rank, its shard) pairs: rank r gets its data-parallel group's shard r // sequence_parallel_size."""
        sp = self.cfg.learner.sequence_parallel_size
        return [(rank, shards[r // sp]) for r, rank in enumerate(self.ranks)]

    def _first_of_groups(self, results: list) -> list:
        """One result per data-parallel group (its SP ranks return the same rows)."""
        return results[:: self.cfg.learner.sequence_parallel_size]

    def train_step(self, samples: dict[str, list], normalizer: LossNormalizer) -> dict[str, float]:
        _, shards, count = balanced_shards(samples, self.cfg, len(self.ranks))
        # Per-token metrics add up over SP slices; the ranks count per-sample ones on SP rank 0 only.
        results = ray.get([rank.train_step.remote(s, normalizer, count) for rank, s in self._group_shards(shards)])
        summed: dict[str, float] = {}
        for metrics in results:
            for key, value in metrics.items():
                summed[key] = max(summed.get(key, value), value) if key.endswith("_max") else summed.get(key, 0.0) + value
        summed["learner/effective_token_frac"] = (summed["learner/real_tokens"]
                                                  / max(summed["learner/processed_tokens"], 1.0))
        return summed

    def ref_logprobs(self, samples: dict[str, list]) -> list[list[float]]:
        parts, shards, count = balanced_shards(samples, self.cfg, len(self.ranks))
        return merge_rows(parts, self._first_of_groups(
            ray.get([rank.ref_logprobs.remote(s, count) for rank, s in self._group_shards(shards)])))

    def policy_logprobs(self, samples: dict[str, list]) -> list[list[float]]:
        parts, shards, count = balanced_shards(samples, self.cfg, len(self.ranks))
        return merge_rows(parts, self._first_of_groups(
            ray.get([rank.policy_logprobs.remote(s, count) for rank, s in self._group_shards(shards)])))

    def publish_weights(self) -> dict:
        return ray.get([rank.publish_weights.remote() for rank in self.ranks])[0]

    def save_hf(self, folder: str) -> str:
        return ray.get([rank.save_hf.remote(folder) for rank in self.ranks])[0]

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
