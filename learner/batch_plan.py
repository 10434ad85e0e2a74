"""The one plan that splits a training batch over a rank group's data-parallel groups and their micro-batches, for
the policy's learner ranks and the critic's alike, and the merge of the ranks' per-sample rows back into batch order.

Made once per call by the driver (cluster/learner_group.py, cluster/critic_group.py) and carried to the ranks with
their shards, so a rank never re-plans: it runs the micro-batches it is given, in order. Every rank runs the same
number of them (ZeRO reduces gradients inside backward and ZeRO-3 gathers parameters inside forward: both are
collectives); an empty micro-batch is a padding one the rank runs masked. Pure; the partitioning itself is
learner/micro_batches.py.
"""

from dataclasses import dataclass

import torch

from learner.micro_batches import plan_ranks, sample_count_micro_batches, token_budget_micro_batches
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch


@dataclass(frozen=True)
class MicroBatching:
    """How a shard is cut into micro-batches: the policy's from learner.*, the critic's from critic.*."""

    micro_batch_size: int
    """Samples per micro-batch when max_tokens is 0."""
    max_tokens: int = 0
    """Token budget of a micro-batch (prompt + response tokens); 0: micro_batch_size samples each."""
    padded: bool = True
    """The micro-batches become padded rows (a budget then counts rows x the longest); False: packed rows."""

    @classmethod
    def of_policy(cls, cfg: RunConfig) -> "MicroBatching":
        """learner.micro_batch_size or learner.max_tokens_per_micro_batch; sequence-parallel rows are always packed
        (learner/sequence_parallel.py pack_row)."""
        lcfg = cfg.learner
        return cls(lcfg.micro_batch_size, lcfg.max_tokens_per_micro_batch,
                   padded=not (lcfg.packing or lcfg.sequence_parallel_size > 1))

    @classmethod
    def of_critic(cls, cfg: RunConfig) -> "MicroBatching":
        """critic.micro_batch_size samples, padded (the critic has no token budget and no packing)."""
        return cls(cfg.critic.micro_batch_size)


@dataclass
class BatchPlan:
    shards: list[list[int]]
    """Sample indices of the batch per data-parallel group (one rank, or sequence_parallel_size ranks)."""
    micro_batches: list[list[list[int]]]
    """Per group, the micro-batches as indices into that group's shard; every group has the same count."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0


def micro_batches_of(tokens: list[int], rule: MicroBatching, count: int = 0) -> list[list[int]]:
    """Indices of one shard's micro-batches from its samples' token counts (prompt + response): token-budget
    ones with rule.max_tokens > 0, else rule.micro_batch_size samples each; at least `count` of them (empty lists
    pad the rest)."""
    if rule.max_tokens > 0:
        plan = token_budget_micro_batches(tokens, rule.max_tokens, count=count, padded=rule.padded)
    else:
        plan = sample_count_micro_batches(len(tokens), rule.micro_batch_size)
    return plan + [[] for _ in range(count - len(plan))]


def plan_batch(batch: TrainingBatch, rule: MicroBatching, num_groups: int) -> BatchPlan:
    """Split `batch` over `num_groups` data-parallel groups of about equal token loads (sample counts equal too,
    or one apart where num_groups does not divide them, with sample-count micro-batches), then each shard into
    micro-batches, padded to the largest count."""
    tokens = batch.sample_tokens()
    shards = plan_ranks(tokens, num_groups, rule.max_tokens)
    count = max(len(micro_batches_of([tokens[i] for i in shard], rule)) for shard in shards)
    return BatchPlan(shards, [micro_batches_of([tokens[i] for i in shard], rule, count) for shard in shards])


def plan_one_shard(batch: TrainingBatch, rule: MicroBatching) -> list[list[int]]:
    """Micro-batches of a batch one process handles alone (a reference worker, a critic rank valuing a group from
    the stream, a single learner rank in tests)."""
    return micro_batches_of(batch.sample_tokens(), rule)


def merge_rows(batch: TrainingBatch, plan: BatchPlan, results: list[torch.Tensor]) -> torch.Tensor:
    """(B, T) of the whole batch from each group's (B_g, T_g) rows (log-probs, values), in the plan's sample
    order; a group's rows are as wide as its own longest response."""
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
    for idx, rows in zip(plan.shards, results):
        if idx:
            out[torch.tensor(idx), : rows.shape[1]] = rows
    return out
