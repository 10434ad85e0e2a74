"""Several optimizer steps per global batch (learner.ppo_epochs x learner.mini_batches_per_step): which samples each
update trains on and how the updates' metrics add up (each mini-batch's normalizer is count_normalizer of its
own loss_mask). Pure; the driver's
learner group (cluster/learner_group.py) runs the plan, one sharded DeepSpeed step per mini-batch.
"""

import numpy as np

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
