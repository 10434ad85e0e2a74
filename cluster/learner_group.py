"""The learner group: N DeepSpeed ranks as Ray actors, driven together.

Every call fans out to all ranks at once (DeepSpeed collectives need every rank), with the global batch split
into shards of about equal token counts (learner/micro_batches.py) and every rank told the same number of
micro-batches. Rank 0 returns what only it holds (published weights, the saved model). With
learner.sequence_parallel_size = sp > 1 the batch is split over the num_ranks / sp data-parallel groups: ranks
r of one group (r // sp equal) get the same shard, and scores come back from the group's first rank.
"""

import socket

import ray

from learner.learner_actor import LearnerRank
from learner.rank_setup import plan_micro_batches, sample_tokens
from learner.micro_batches import plan_ranks
from learner.objective import LossNormalizer, combine_metrics, finalize_metrics, needs_proximal_logprobs
from learner.update_plan import check_batch_normalizer, combine_updates, mini_batch_order, sample_normalizer
from learner.weight_backends import weight_backend
from protocols.config import RunConfig
from cluster.learner_failure import gather_ranks
from cluster.placement import Placement, create_placement
from cluster.ray_setup import learner_options


def rendezvous_address(_rank0, all_on_one_node: bool) -> tuple[str, int]:
    """Runs inside rank 0's actor: a free port on its own node (a port free on the driver's node may be taken
    there), and its address, or loopback when every rank shares the node."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ("127.0.0.1" if all_on_one_node else ray.util.get_node_ip_address()), port


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
        master, port = ray.get(self.ranks[0].__ray_call__.remote(rendezvous_address, one_node))
        ray.get([rank.setup.remote(master, port) for rank in self.ranks])
        self.batches_trained = 0  # seeds each batch's mini-batch shuffle
        self.last_update_metrics: list[dict[str, float]] = []

    def _gather(self, refs: list, what: str) -> list:
        """Results of one call per rank; a dead rank raises LearnerRankLost naming it (cluster/learner_failure.py)."""
        return gather_ranks(refs, self.ranks, self.placement, what, self.cfg.fault.learner_timeout_s)

    def _group_shards(self, shards: list[dict]) -> list[tuple]:
        """(rank, its shard) pairs: rank r gets its data-parallel group's shard r // sequence_parallel_size."""
        sp = self.cfg.learner.sequence_parallel_size
        return [(rank, shards[r // sp]) for r, rank in enumerate(self.ranks)]

    def _first_of_groups(self, results: list) -> list:
        """One result per data-parallel group (its SP ranks return the same rows)."""
        return results[:: self.cfg.learner.sequence_parallel_size]

    def train_step(self, samples: dict[str, list], normalizer: LossNormalizer) -> dict[str, float]:
        """Train on one global batch: learner.ppo_epochs passes of learner.mini_batches_per_step optimizer steps
        each (learner/update_plan.py), one step with the defaults. `normalizer` counts the whole batch's loss
        tokens (count_normalizer); with several updates each mini-batch's own counts are taken from its samples.
        In decoupled mode with several updates the proximal log-probs are scored once, before the first update,
        so later updates clip against the policy the batch started from. Returns summed metrics for
        finalize_metrics, with learner/clip_frac_epoch<e> and learner/optimizer_steps."""
        lcfg = self.cfg.learner
        plan = mini_batch_order(len(samples["prompt_ids"]), lcfg.ppo_epochs, lcfg.mini_batches_per_step,
                                (self.cfg.train.seed, self.batches_trained))
        self.batches_trained += 1
        per_update = []
        if len(plan) * len(plan[0]) == 1:
            # One update: its own forward pass gives the proximal log-probs (the weights before the update).
            per_update.append((0, self._update(samples, normalizer)))
        else:
            lengths = [len(r) for r in samples["response_ids"]]
            check_batch_normalizer(normalizer, lengths, samples["sample_mask"])
            if needs_proximal_logprobs(self.cfg.algorithm):
                samples = {**samples, "proximal_logprobs": self.policy_logprobs(samples)}
            for epoch, mini_batches in enumerate(plan):
                for idx in mini_batches:
                    part = {k: [v[i] for i in idx] for k, v in samples.items()}
                    part_normalizer = sample_normalizer(lengths, samples["sample_mask"], idx,
                                                        normalizer.max_response_tokens)
                    per_update.append((epoch, self._update(part, part_normalizer)))
        # Each update's own means (clip fraction of the first mini-batch, ...), for a closer look than the epochs.
        self.last_update_metrics = [finalize_metrics(m) for _, m in per_update]
        summed = combine_updates(per_update, lcfg.ppo_epochs)
        # each rank's running count, the same on every rank (they agree to skip): the max is the run's count
        summed["learner/skipped_nonfinite"] = summed.pop("learner/skipped_nonfinite_max", 0.0)
        summed["learner/effective_token_frac"] = (summed["learner/real_tokens"]
                                                  / max(summed["learner/processed_tokens"], 1.0))
        return summed

    def _update(self, samples: dict[str, list], normalizer: LossNormalizer) -> dict[str, float]:
        """One optimizer step on `samples` (a batch or a mini-batch), split over the ranks; summed metrics."""
        _, shards, count = balanced_shards(samples, self.cfg, len(self.ranks))
        # Per-token metrics add up over SP slices; the ranks count per-sample ones on SP rank 0 only.
        results = self._gather([rank.train_step.remote(s, normalizer, count)
                                for rank, s in self._group_shards(shards)], "a training step")
        return combine_metrics(results)

    def ref_logprobs(self, samples: dict[str, list]) -> list[list[float]]:
        parts, shards, count = balanced_shards(samples, self.cfg, len(self.ranks))
        return merge_rows(parts, self._first_of_groups(
            ray.get([rank.ref_logprobs.remote(s, count) for rank, s in self._group_shards(shards)])))

    def policy_logprobs(self, samples: dict[str, list]) -> list[list[float]]:
        parts, shards, count = balanced_shards(samples, self.cfg, len(self.ranks))
        return merge_rows(parts, self._first_of_groups(
            ray.get([rank.policy_logprobs.remote(s, count) for rank, s in self._group_shards(shards)])))

    def publish_weights(self, version: int = 0) -> dict:
        return self._gather([rank.publish_weights.remote(version) for rank in self.ranks], "a weight publish")[0]

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
        return self._gather([rank.save_hf.remote(folder) for rank in self.ranks], "a model save")[0]

    def save_state(self, folder: str) -> list[dict]:
        """Every rank writes its part of the DeepSpeed checkpoint and its RNG states under `folder` (one folder all
        ranks reach: across nodes, a shared filesystem). Returns each rank's optimizer digest."""
        return self._gather([rank.save_state.remote(folder) for rank in self.ranks], "a checkpoint save")

    def load_state(self, folder: str) -> list[dict]:
        """Every rank loads its part of what save_state wrote; returns each rank's optimizer digest as loaded."""
        return self._gather([rank.load_state.remote(folder) for rank in self.ranks], "a checkpoint load")

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
        if self._own_placement:
            self.placement.remove()
