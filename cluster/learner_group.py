"""The learner group: N DeepSpeed ranks as Ray actors (a RankGroup, cluster/rank_group.py), driven together.

Every call fans out to all ranks at once (DeepSpeed collectives need every rank), with the TrainingBatch split
by one plan (learner/batch_plan.py) into shards of about equal token counts and their micro-batches, the same
number on every rank. Rank 0 returns what only it holds (published weights, the saved model). With
learner.sequence_parallel_size = sp > 1 the batch is split over the num_ranks / sp data-parallel groups: ranks
r of one group (r // sp equal) get the same shard, and scores come back from the group's first rank.
"""

import ray
import torch

from learner.batch_plan import BatchPlan, MicroBatching, merge_rows, plan_batch
from learner.learner_actor import LearnerRank
from learner.objective import LossNormalizer, combine_metrics, count_normalizer, finalize_metrics, needs_proximal_logprobs
from learner.update_plan import combine_updates, mini_batch_order
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch
from protocols.weight_announcement import WeightAnnouncement
from weights.backends import weight_backend
from cluster.placement import Placement, create_placement
from cluster.rank_group import RankGroup
from cluster.ray_setup import learner_options


class LearnerGroup:
    def __init__(self, cfg: RunConfig, model_path: str, placement: Placement | None = None) -> None:
        """Start the ranks in the learner's placement group (the run's, or one of its own when None) and join
        them into one process group."""
        self.cfg = cfg
        self._own_placement = placement is None
        self.placement = placement or create_placement(cfg, roles=("learner",))
        self.group = RankGroup(LearnerRank, "learner", cfg, model_path,
                               [learner_options(cfg, self.placement, r) for r in range(cfg.learner.num_ranks)],
                               placement=self.placement)
        self.ranks = self.group.ranks
        self.batches_trained = 0  # seeds each batch's mini-batch shuffle
        self.last_update_metrics: list[dict[str, float]] = []

    def _gather(self, refs: list, what: str) -> list:
        """Results of one call per rank within fault.learner_timeout_s; a dead rank raises LearnerRankLost naming it."""
        return self.group.gather(refs, what)

    def _fan_out(self, method: str, batch: TrainingBatch, *args) -> tuple[BatchPlan, list]:
        """Plan `batch` over the data-parallel groups once and call `method(shard, *args, plan=micro-batches)` on
        every rank: rank r gets its group's shard r // sequence_parallel_size (its SP ranks share it). Returns the
        plan and the refs, one per rank."""
        sp = self.cfg.learner.sequence_parallel_size
        plan = plan_batch(batch, MicroBatching.of_policy(self.cfg), len(self.ranks) // sp)
        return plan, self.group.call_sharded(method, batch, plan, *args, ranks_per_shard=sp)

    def train_step(self, batch: TrainingBatch, normalizer: LossNormalizer) -> dict[str, float]:
        """Train on one global batch: learner.ppo_epochs passes of learner.mini_batches_per_step optimizer steps
        each (learner/update_plan.py), one step with the defaults. `normalizer` counts the whole batch's loss
        tokens (count_normalizer of batch.loss_mask); each mini-batch's own is counted from its loss_mask. In
        decoupled mode with several updates the proximal log-probs are scored once, before the first update, so
        later updates clip against the policy the batch started from. Returns summed metrics for
        finalize_metrics, with learner/clip_frac_epoch<e> and learner/optimizer_steps."""
        lcfg = self.cfg.learner
        order = mini_batch_order(batch.num_samples, lcfg.ppo_epochs, lcfg.mini_batches_per_step,
                                 (self.cfg.train.seed, self.batches_trained))
        self.batches_trained += 1
        per_update = []
        if len(order) * len(order[0]) == 1:
            # One update: its own forward pass gives the proximal log-probs (the weights before the update).
            per_update.append((0, self._update(batch, normalizer)))
        else:
            if needs_proximal_logprobs(self.cfg.algorithm):
                batch = batch.with_fields(proximal_logprobs=self.policy_logprobs(batch))
            for epoch, mini_batches in enumerate(order):
                for idx in mini_batches:
                    part = batch.select(idx)
                    per_update.append((epoch, self._update(part, count_normalizer(
                        part.loss_mask, normalizer.max_response_tokens))))
        # Each update's own means (clip fraction of the first mini-batch, ...), for a closer look than the epochs.
        self.last_update_metrics = [finalize_metrics(m) for _, m in per_update]
        summed = combine_updates(per_update, lcfg.ppo_epochs)
        # each rank's running count, the same on every rank (they agree to skip): the max is the run's count
        summed["learner/skipped_nonfinite"] = summed.pop("learner/skipped_nonfinite_max", 0.0)
        summed["learner/effective_token_frac"] = (summed["learner/real_tokens"]
                                                  / max(summed["learner/processed_tokens"], 1.0))
        return summed

    def _update(self, batch: TrainingBatch, normalizer: LossNormalizer) -> dict[str, float]:
        """One optimizer step on `batch` (a batch or a mini-batch), split over the ranks; summed metrics."""
        _, refs = self._fan_out("train_step", batch, normalizer)
        # Per-token metrics add up over SP slices; the ranks count per-sample ones on SP rank 0 only.
        return combine_metrics(self._gather(refs, "a training step"))

    def _score(self, method: str, batch: TrainingBatch) -> torch.Tensor:
        plan, refs = self._fan_out(method, batch)
        # one result per data-parallel group: its SP ranks return the same rows
        results = self._gather(refs, "a scoring pass")[:: self.cfg.learner.sequence_parallel_size]
        return merge_rows(batch, plan, results)

    def ref_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        """(B, T) reference log-probs of the batch's loss tokens, from the ranks' own reference model."""
        return self._score("ref_logprobs", batch)

    def policy_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        """(B, T) current-policy log-probs of the batch's loss tokens."""
        return self._score("policy_logprobs", batch)

    def probe_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        """(B, T) current-policy log-probs at temperature 1 (the weight-sync check's probe)."""
        return self._score("probe_logprobs", batch)

    def publish_weights(self, version: int = 0) -> WeightAnnouncement:
        """Rank 0's announcement of `version` (every rank takes part: under ZeRO-3 the weights are gathered)."""
        return self._gather(self.group.call("publish_weights", version), "a weight publish")[0]

    def join_weight_group(self, engines: list) -> dict:
        """For a weight transport that forms a group (`collective`; WeightBackend.group_info): learner rank 0
        (group rank 0) and one receiver per rollout engine (ranks 1..N) open the weight group together. An engine
        with tensor parallelism joins once: its receiver loads the full checkpoint-format tensors into every
        engine rank, and vLLM's weight loaders shard them. Returns the join info ({} for a transport without a
        group: nothing to join). Raises with the settings to change if a member cannot join in time."""
        backend = weight_backend(self.cfg)
        if not backend.forms_group:
            return {}
        host, port = ray.get(self.ranks[0].weight_group_address.remote())
        info = backend.group_info(self.cfg, host, port, 1 + len(engines),
                                  ray.get(self.ranks[0].weight_metas.remote()))
        refs = [self.ranks[0].join_weight_group.remote(info)]
        refs += [engine.join_weight_group.remote({**info, "rank": 1 + i}) for i, engine in enumerate(engines)]
        # Each member times out on its own after timeout_s; the margin covers actor start and the store.
        ray.get(refs, timeout=info["timeout_s"] + 60)
        return info

    def save_hf(self, folder: str) -> str:
        return self._gather(self.group.call("save_hf", folder), "a model save")[0]

    def save_state(self, folder: str) -> list[dict]:
        """Every rank writes its part of the DeepSpeed checkpoint and its RNG states under `folder` (one folder all
        ranks reach: across nodes, a shared filesystem). Returns each rank's optimizer digest."""
        return self._gather(self.group.call("save_state", folder), "a checkpoint save")

    def load_state(self, folder: str) -> list[dict]:
        """Every rank loads its part of what save_state wrote; returns each rank's optimizer digest as loaded."""
        return self._gather(self.group.call("load_state", folder), "a checkpoint load")

    def shutdown(self) -> None:
        self.group.shutdown()
        if self._own_placement:
            self.placement.remove()
