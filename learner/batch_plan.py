"""The one plan that splits a training batch over the learner's data-parallel groups and their micro-batches.

Made once per update by the driver (cluster/learner_group.py) and carried to the ranks with their shards, so a
rank never re-plans: it runs the micro-batches it is given, in order. Every rank runs the same number of them
(ZeRO reduces gradients inside backward and ZeRO-3 gathers parameters inside forward: both are collectives); an
empty micro-batch is a padding one the rank runs masked. Pure; the partitioning itself is learner/micro_batches.py.
"""

from dataclasses import dataclass

from learner.micro_batches import plan_ranks, sample_count_micro_batches, token_budget_micro_batches
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch


@dataclass
class BatchPlan:
    shards: list[list[int]]
    """Sample indices of the batch per data-parallel group (one rank, or sequence_parallel_size ranks)."""
    micro_batches: list[list[list[int]]]
    """Per group, the micro-batches as indices into that group's shard; every group has the same count."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0


def micro_batches_of(tokens: list[int], cfg: RunConfig, count: int = 0) -> list[list[int]]:
    """Indices of one shard's micro-batches from its samples' token counts (prompt + response): token-budget
    ones with learner.max_tokens_per_micro_batch > 0, else learner.micro_batch_size samples each; at least
    `count` of them (empty lists pad the rest)."""
    budget = cfg.learner.max_tokens_per_micro_batch
    if budget > 0:
        # Sequence-parallel rows are always packed (learner/sequence_parallel.py pack_row).
        plan = token_budget_micro_batches(tokens, budget, count=count,
                                          padded=not (cfg.learner.packing or cfg.learner.sequence_parallel_size > 1))
    else:
        plan = sample_count_micro_batches(len(tokens), cfg.learner.micro_batch_size)
    return plan + [[] for _ in range(count - len(plan))]


def plan_batch(batch: TrainingBatch, cfg: RunConfig, num_groups: int) -> BatchPlan:
    """Split `batch` over `num_groups` data-parallel groups of about equal token loads (equal sample counts too
    with sample-count micro-batches), then each shard into micro-batches, padded to the largest count."""
    tokens = batch.sample_tokens()
    shards = plan_ranks(tokens, num_groups, cfg.learner.max_tokens_per_micro_batch)
    count = max(len(micro_batches_of([tokens[i] for i in shard], cfg)) for shard in shards)
    return BatchPlan(shards, [micro_batches_of([tokens[i] for i in shard], cfg, count) for shard in shards])


def plan_one_shard(batch: TrainingBatch, cfg: RunConfig) -> list[list[int]]:
    """Micro-batches of a batch one process scores alone (a reference worker, a single learner rank in tests)."""
    return micro_batches_of(batch.sample_tokens(), cfg)
