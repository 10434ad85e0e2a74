"""Several optimizer steps per global batch (learner.ppo_epochs x learner.mini_batches_per_step): which samples each
update trains on, the exact loss normalizers of each, and how the updates' metrics add up. Pure; the driver's
learner group (cluster/learner_group.py) runs the plan, one sharded DeepSpeed step per mini-batch.
"""

import numpy as np

from learner.aggregation import LossNormalizer
from learner.objective import combine_metrics, finalize_metrics


def mini_batch_order(num_samples: int, ppo_epochs: int, mini_batches: int,
                     seed: tuple[int, ...]) -> list[list[list[int]]]:
    """Sample indices of each mini-batch of each epoch: [epoch][mini-batch] -> sorted indices.

    Every epoch draws its own permutation of the batch (numpy, seeded by `seed` plus the epoch, so a rerun trains
    the same mini-batches) and cuts it into `mini_batches` parts whose sizes differ by at most one. Indices inside
    a mini-batch are sorted: its order does not change the update, and one mini-batch is then the batch itself,
    in its own order, whatever the seed."""
    if not 1 <= mini_batches <= num_samples:
        raise ValueError(f"learner.mini_batches_per_step={mini_batches} must be between 1 and the batch's "
                         f"{num_samples} samples")
    plan = []
    for epoch in range(ppo_epochs):
        order = np.random.default_rng([*seed, epoch]).permutation(num_samples)
        plan.append([sorted(int(i) for i in part) for part in np.array_split(order, mini_batches)])
    return plan


def sample_normalizer(response_lengths: list[int], sample_mask: list[bool], idx: list[int],
                      max_response_tokens: int) -> LossNormalizer:
    """The normalizer of the samples `idx` (a mini-batch): every response token of a kept sample is a loss
    token, as the driver's loss mask (response positions AND sample_mask) has it; count_normalizer's rule."""
    kept = [response_lengths[i] for i in idx if sample_mask[i]]
    return LossNormalizer(global_num_tokens=float(sum(kept)), global_num_sequences=float(sum(n > 0 for n in kept)),
                          max_response_tokens=int(max_response_tokens))


def check_batch_normalizer(normalizer: LossNormalizer, response_lengths: list[int], sample_mask: list[bool]) -> None:
    """Mini-batch normalizers are counted from the samples; refuse a driver whose batch normalizer counted
    another loss mask, since then each mini-batch would need that mask too."""
    whole = sample_normalizer(response_lengths, sample_mask, list(range(len(response_lengths))),
                              normalizer.max_response_tokens)
    if (whole.global_num_tokens, whole.global_num_sequences) != (normalizer.global_num_tokens,
                                                                  normalizer.global_num_sequences):
        raise ValueError(
            f"the batch's LossNormalizer counts {normalizer.global_num_tokens:g} tokens in "
            f"{normalizer.global_num_sequences:g} sequences, but its samples hold {whole.global_num_tokens:g} response "
            f"tokens in {whole.global_num_sequences:g} kept sequences (sample_mask): with "
            "learner.mini_batches_per_step > 1 or learner.ppo_epochs > 1 each mini-batch's normalizer is counted from "
            "its samples, so the loss mask must be the response tokens of the kept samples. Pass "
            "count_normalizer(response mask & sample_mask) or train with one update per batch")


_PER_EPOCH = ("clip_frac",)
"""Metrics also reported per epoch, as learner/<name>_epoch<e> (epoch 0 shows the first pass, later ones how far
the clip holds the policy)."""


def combine_updates(per_update: list[tuple[int, dict[str, float]]], ppo_epochs: int) -> dict[str, float]:
    """Summed metrics of one batch from its updates' summed metrics, (epoch, metrics of one update over all
    ranks), in the form finalize_metrics reads. Every epoch covers the batch once, so additive sums are divided
    by ppo_epochs (counts stay the batch's, per-token means become means over all updates); `loss` is the mean
    of the updates' losses; learner_seconds_max adds up (the updates run one after another); other `_max` keys
    take the max and learner/* work counts (tokens processed) add up over all passes. Adds learner/<m>_epoch<e>
    for the per-epoch metrics and learner/optimizer_steps (updates in this batch)."""
    summed = combine_metrics([m for _, m in per_update])
    for key in summed:
        if not key.startswith("learner/") and not key.endswith("_max"):
            summed[key] /= ppo_epochs
    if "loss" in summed:
        summed["loss"] /= len(per_update) / ppo_epochs
    summed["learner_seconds_max"] = sum(m.get("learner_seconds_max", 0.0) for _, m in per_update)
    for epoch in range(ppo_epochs):
        means = finalize_metrics(combine_metrics([m for e, m in per_update if e == epoch]))
        for name in _PER_EPOCH:
            if name in means:
                summed[f"learner/{name}_epoch{epoch}"] = means[name]
    summed["learner/optimizer_steps"] = float(len(per_update))
    return summed
