"""Preparing a step's batch: the one place between the replay queue and the learner ranks where the algorithm
turns scored samples into what the loss reads. Pure: a function of the batch and the config, no Ray.

    TrainingBatch (rewards, behavior / ref log-probs from the stream, the critic's values from the step)
    -> reward shaping (drops samples from the loss) -> KL in the reward -> GAE returns for a critic
    -> advantages -> the teacher's per-token share (on-policy distillation; with a top-k teacher, the reward's
    share only: the ranks add the top-k loss) -> the loss normalizer

The driver (cluster/trainer.py) only waits for a batch, asks the learner for reference log-probs when
`learner_scores_ref` says the ranks hold the reference, calls `prepare_batch`, trains and publishes.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from learner.aggregation import LossNormalizer, count_normalizer
from learner.distillation import distillation_metrics, mix_advantages, teacher_advantages, topk_mass
from learner.objective import (
    apply_reward_shaping,
    compute_advantages,
    gae_targets,
    kl_for_reward,
    kl_in_reward,
    needs_ref_logprobs,
)
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch
from protocols.trajectory import TOKEN_SCORERS, Trajectory


@dataclass(frozen=True)
class PreparedBatch:
    """A batch ready for the learner ranks (and the critic's, when it has `returns`)."""

    batch: TrainingBatch
    """The samples with `advantages` set, `loss_mask` narrowed by the shaping's sample mask, and `ref_logprobs`
    and `returns` where the algorithm reads them."""
    shaped_rewards: Tensor
    """(B,) float32: the verifier's rewards after the algorithm's shaping (overlong penalty), before any KL."""
    normalizer: LossNormalizer
    """The global token and sequence counts every rank's loss divides by."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What preparing measured for metrics.jsonl: `teacher/*` when a teacher scored the batch."""


def streams_ref(cfg: RunConfig) -> bool:
    """True when reference workers score every group on its way to the queue (reference.num_workers > 0)."""
    return cfg.reference.num_workers > 0


def learner_scores_ref(cfg: RunConfig) -> bool:
    """True when the driver must ask the learner ranks for the batch's reference log-probs before preparing it:
    the ranks hold the reference (reference.num_workers = 0), a KL term is on, and the log-probs are read outside
    a single update (the KL in the reward, or several updates of the batch: scored once, read by each). With the
    KL in the loss and one update, the ranks score the reference inside the update instead."""
    if streams_ref(cfg) or not needs_ref_logprobs(cfg.algorithm):
        return False
    return (kl_in_reward(cfg.algorithm) or cfg.learner.ppo_epochs > 1 or cfg.learner.mini_batches_per_step > 1)


def check_streamed_scores(batch: TrainingBatch, cfg: RunConfig, group_ids: list[str]) -> None:
    """Raise naming the groups when the workers of a token-scoring role (reference, teacher: TOKEN_SCORERS) run
    and the batch lacks their log-probs: the controller queues a group only once every scoring stage has run, so
    a missing stamp is a bug, never something to fill in or train without. `group_ids`: the batch's samples'
    groups, in order."""
    for role, name in TOKEN_SCORERS.items():
        workers = getattr(cfg, role).num_workers
        if workers and getattr(batch, name) is None:
            raise RuntimeError(
                f"{role}.num_workers={workers} but the batch reached the learner without {name} (groups "
                f"{sorted(set(group_ids))[:5]}); every group should pass a {role} worker on its way to the queue")
    top_k = cfg.algorithm.distillation.top_k
    if top_k and cfg.teacher.num_workers and batch.teacher_topk_ids is None:
        raise RuntimeError(
            f"algorithm.distillation.top_k={top_k} but the batch reached the learner without the teacher's top-k "
            f"(teacher_topk_ids; groups {sorted(set(group_ids))[:5]}): every teacher worker of this run ships them")


def reward_kl(batch: TrainingBatch, cfg: RunConfig) -> Tensor | None:
    """(B, T) per-token KL to place in the reward, or None when the KL is not in the reward: the estimator
    `algorithm.kl.estimator` of KL(mu || ref) on the loss tokens, from the behavior log-probs mu in every
    off-policy mode (learner/objective.py kl_for_reward says why not the proximal ones)."""
    if not kl_in_reward(cfg.algorithm):
        return None
    if batch.ref_logprobs is None:
        raise ValueError("algorithm.kl.placement=reward needs the batch's ref_logprobs (streamed by reference workers, "
                         "or scored by the learner group: see learner_scores_ref)")
    return kl_for_reward(batch.behavior_logprobs, batch.ref_logprobs, batch.loss_mask, cfg.algorithm)


def critic_returns(batch: TrainingBatch, rewards: Tensor, cfg: RunConfig, kl: Tensor | None) -> Tensor:
    """(B, T) GAE returns over the loss tokens from the values the critic computed on this batch before its
    update (cluster/critic_pool.py score_batch): the critic's regression targets (the values themselves are the
    clipped value loss's old values and GAE's baseline). Raises when the batch has no values."""
    if batch.values is None:
        raise RuntimeError(
            f"critic.num_workers={cfg.critic.num_workers} but a batch reached the learner without critic values: "
            "the critic scores every batch at train time, before the advantages (CriticPool.score_batch)")
    _, returns = gae_targets(rewards, batch.loss_mask, cfg.algorithm, kl=kl, values=batch.values)
    return returns


def prepare_batch(batch: TrainingBatch, cfg: RunConfig) -> PreparedBatch:
    """The batch the learner trains on: shaping, the KL in the reward, the critic's returns, advantages (mixed
    with the teacher's per-token advantage when teacher log-probs came with the batch) and the loss normalizer, each computed once over the whole global batch (group baselines span ranks). `batch` must
    already carry what the stream scored (ref_logprobs with reference workers), the critic's values with a critic and, when
    `learner_scores_ref(cfg)`, the learner's reference log-probs. A batch whose `group_index` is not whole groups
    of rollout.samples_per_prompt in a row is refused: its advantages would mix groups."""
    check_whole_groups(batch, cfg.rollout.samples_per_prompt)
    rewards, sample_mask = apply_reward_shaping(batch.rewards, batch.response_lengths, batch.truncated,
                                                cfg.algorithm, cfg.rollout.max_response_tokens)
    batch = batch.with_sample_mask(sample_mask)
    kl = reward_kl(batch, cfg)
    if cfg.critic.enabled:
        batch = batch.with_fields(returns=critic_returns(batch, rewards, cfg, kl))
    advantages = compute_advantages(rewards, batch.loss_mask, cfg.rollout.samples_per_prompt, cfg.algorithm,
                                    kl=kl, values=batch.values)
    metrics: dict[str, float] = {}
    if batch.teacher_logprobs is not None:
        weight = cfg.algorithm.distillation.weight
        metrics = distillation_metrics(batch.behavior_logprobs, batch.teacher_logprobs, batch.loss_mask,
                                       advantages, weight)
        if cfg.algorithm.distillation.top_k:
            # the teacher's share is the ranks' top-k loss (weight * KL), not a term of the advantage
            metrics.pop("teacher/advantage_share", None)
            metrics["teacher/topk_mass"] = topk_mass(batch.teacher_topk_logprobs, batch.loss_mask)
            from_teacher = torch.zeros_like(advantages)
        else:
            from_teacher = teacher_advantages(batch.behavior_logprobs, batch.teacher_logprobs, batch.loss_mask)
        advantages = mix_advantages(advantages, from_teacher, weight)
    # the ranks read the advantages (and the teacher's top-k, for its loss), not the teacher's sampled-token
    # log-probs: they need not travel
    batch = batch.with_fields(advantages=advantages, teacher_logprobs=None)
    return PreparedBatch(batch=batch, shaped_rewards=rewards,
                         normalizer=count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens),
                         metrics=metrics)


def check_whole_groups(batch: TrainingBatch, group_size: int) -> None:
    """Raise ValueError unless the rows are whole groups of `group_size` in a row, as the advantages take them
    (nothing to check on a batch built without group ids)."""
    if batch.group_index is None:
        return
    _, sizes = torch.unique_consecutive(batch.group_index, return_counts=True)
    regrouped = len(torch.unique(batch.group_index)) != len(sizes)
    if regrouped or bool((sizes != group_size).any()):
        raise ValueError(f"the batch's rows hold groups of {sizes.tolist()} samples in a row"
                         f"{' (a group split over non-adjacent rows)' if regrouped else ''}, not "
                         f"rollout.samples_per_prompt={group_size} each: their advantages would mix groups. The "
                         "queue returns whole groups; a batch built by hand must keep each group's samples together")


def staleness_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """staleness/*: how many versions behind `version` each sample's oldest sampled token is, as mean, max, a
    histogram, and the share of samples whose tokens span several versions. Each sample's oldest and newest
    version are the trajectory's own (Trajectory.min_version, max_version: the engine's tokens only), the values
    the replay queue drops stale groups by."""
    spans = [t.version_span for t in trajectories]  # one walk of each sample's tokens
    lags = [version - oldest for oldest, _ in spans]
    out = {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}
    for lag in sorted(set(lags)):
        out[f"staleness/hist_{lag}"] = lags.count(lag) / len(lags)
    out["staleness/mixed_version_frac"] = sum(oldest != newest for oldest, newest in spans) / len(lags)
    return out
