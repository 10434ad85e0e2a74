"""The learner's objective: the only module the training loop imports. It reads an AlgorithmConfig and composes
advantages.py, shaping.py, off_policy.py, policy_losses.py, kl.py and aggregation.py.

Driver side, once per global batch: apply_reward_shaping -> compute_advantages. Per micro-batch on every rank:
compute_policy_loss (its losses and metric sums add up across micro-batches and ranks) -> finalize_metrics.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from learner.advantages import (
    broadcast_to_tokens,
    gae_advantage,
    group_mean_advantage,
    grpo_advantage,
    masked_whiten,
    reinforce_advantage,
    reinforce_pp_advantage,
    rloo_advantage,
    token_level_rewards,
    zero_variance_groups,
)
from learner.aggregation import LossNormalizer, aggregate_loss, count_normalizer
from learner.distillation import topk_forward_kl
from learner.kl import entropy_from_logits, kl_estimate
from learner.off_policy import behavior_weights
from learner.policy_losses import POLICY_LOSSES
from learner.shaping import overlong_buffer_tokens, overlong_penalty, truncated_sample_mask
from protocols.algorithm import AlgorithmConfig
from protocols.metrics import combine_metrics, merges_by_max  # the one merge rule; re-exported for the learner ranks

__all__ = [
    "AlgorithmConfig", "LossNormalizer", "PolicyLossInputs", "apply_reward_shaping", "compute_advantages",
    "combine_metrics", "compute_policy_loss", "count_normalizer", "entropy_from_logits", "finalize_metrics",
    "gae_targets", "kl_estimate", "kl_for_reward", "kl_in_reward", "needs_proximal_logprobs", "needs_ref_logprobs",
    "needs_values",
    "zero_variance_groups",
]


# ------------------------------------------------------------------------------------------ what is needed


def needs_proximal_logprobs(cfg: AlgorithmConfig) -> bool:
    """True in decoupled mode: the learner must recompute log-probs with its current weights before the update."""
    return cfg.off_policy.mode == "decoupled"


def needs_ref_logprobs(cfg: AlgorithmConfig) -> bool:
    """True when a KL term is active (beta > 0); False means no reference model needs to be loaded."""
    return cfg.kl.beta > 0


def kl_in_reward(cfg: AlgorithmConfig) -> bool:
    """True when beta * KL is subtracted from the rewards (pass `kl` to compute_advantages) instead of the loss."""
    return cfg.kl.beta > 0 and cfg.kl.placement == "reward"


def needs_values(cfg: AlgorithmConfig) -> bool:
    """True when the advantage estimator needs a critic's per-token values (GAE)."""
    return cfg.advantage.type == "gae"


# ------------------------------------------------------------------------------------------- driver side


def apply_reward_shaping(rewards: Tensor, response_lengths: Tensor, truncated: Tensor, cfg: AlgorithmConfig,
                         max_response_tokens: int) -> tuple[Tensor, Tensor]:
    """rewards (N,), response_lengths (N,) int, truncated (N,) bool (out of tokens or turns).
    Returns (shaped rewards (N,) float32, sample_mask (N,) bool: False for samples to drop from the loss, i.e.
    truncated ones when cfg.mask_truncated). AND sample_mask into loss_mask before compute_advantages."""
    shaped = rewards.to(torch.float32).clone()
    if cfg.overlong.enabled:
        buffer = overlong_buffer_tokens(max_response_tokens, cfg.overlong.buffer_tokens, cfg.overlong.buffer_fraction)
        shaped = shaped + overlong_penalty(response_lengths, max_response_tokens, buffer, cfg.overlong.penalty_factor)
    return shaped, truncated_sample_mask(truncated, cfg.mask_truncated)


def kl_for_reward(behavior_logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor,
                  cfg: AlgorithmConfig) -> Tensor:
    """Per-token KL estimate (N, T), detached, 0 off-mask, to pass as `kl` to compute_advantages when
    kl_in_reward(cfg). beta is applied inside compute_advantages, not here.

    The estimator is `cfg.kl.estimator` (k1 = log mu - log ref for the presets that put the KL in the reward)
    evaluated on the behavior log-probs mu, the vLLM log-probs of the policy that sampled the tokens, in every
    off-policy mode (decoupled and bypass alike). k1 and k3 are unbiased estimates of KL(pi || ref) only for
    tokens drawn from pi: the tokens were drawn from mu, so mu is the policy whose KL they estimate without an
    importance weight, and mu is known before the learner runs (the advantages need the KL before the update;
    proximal log-probs would cost a whole forward pass of the batch first). mu lags the learner's policy by at
    most train.max_staleness versions. `ref_logprobs` come from the reference workers (Trajectory.ref_logprobs)
    or the learner's in-learner reference, scored at the same temperature as mu."""
    mask = loss_mask.bool()
    lp = torch.where(mask, behavior_logprobs.detach().float(), 0.0)
    ref = torch.where(mask, ref_logprobs.detach().float(), 0.0)
    return torch.where(mask, kl_estimate(lp, ref, cfg.kl.estimator), 0.0)


def compute_advantages(rewards: Tensor, loss_mask: Tensor, group_size: int, cfg: AlgorithmConfig, *,
                       kl: Tensor | None = None, values: Tensor | None = None) -> Tensor:
    """rewards (N,) float, loss_mask (N, T) bool, kl (N, T) per-token KL estimate used when the KL is placed in the
    reward (see kl_for_reward), values (N, T) critic values for GAE. Returns advantages (N, T) float32, zero where
    loss_mask is False. Computed once on the whole global batch (the driver holds it), before sharding.

    KL in the reward: sequence-level estimators (reinforce, group_mean/dr_grpo, rloo, grpo) use the shaped scalar
    R - beta * sum_t kl_t; token-level ones (reinforce_pp, gae) subtract beta * kl_t at every token. All samples of
    a group count in its baseline, including samples whose loss_mask is all False (e.g. masked truncated ones)."""
    mask = loss_mask.bool()
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"loss_mask must be (N, T) with N = len(rewards) = {rewards.shape[0]}, "
                         f"got {tuple(mask.shape)}")
    rewards = rewards.to(torch.float32)
    beta = cfg.kl.beta if kl_in_reward(cfg) else 0.0
    if beta > 0 and kl is None:
        raise ValueError(
            f"algorithm.kl.placement=reward with beta={cfg.kl.beta} needs the per-token `kl` argument of "
            "compute_advantages (see kl_for_reward), or set algorithm.kl.beta=0."
        )
    adv_cfg = cfg.advantage
    kind = adv_cfg.type
    if kind in ("reinforce", "group_mean", "dr_grpo", "rloo", "grpo"):
        seq_rewards = rewards
        if beta > 0:
            seq_rewards = rewards - beta * torch.where(mask, kl.to(torch.float32), 0.0).sum(dim=1)
        if kind == "reinforce":
            seq = reinforce_advantage(seq_rewards)
        elif kind in ("group_mean", "dr_grpo"):
            seq = group_mean_advantage(seq_rewards, group_size)
        elif kind == "rloo":
            seq = rloo_advantage(seq_rewards, group_size)
        else:
            seq = grpo_advantage(seq_rewards, group_size, adv_cfg.std, adv_cfg.eps)
        return broadcast_to_tokens(seq, mask)
    if kind == "reinforce_pp":
        adv = reinforce_pp_advantage(rewards, mask, group_size, adv_cfg.group_baseline, kl, beta, adv_cfg.eps)
    elif kind == "gae":
        adv, _returns = gae_targets(rewards, mask, cfg, kl=kl, values=values)
    else:  # pragma: no cover - the config's discriminated union makes this unreachable
        raise ValueError(f"algorithm.advantage.type={kind!r} is not implemented")
    return torch.where(mask, adv, 0.0)


def gae_targets(rewards: Tensor, loss_mask: Tensor, cfg: AlgorithmConfig, *, kl: Tensor | None = None,
                values: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """advantage.type=gae: (advantages (N, T), returns (N, T)), both float32 and 0 off-mask. Token rewards are R on
    the last loss token minus beta * kl_t on every loss token (KL in the reward), GAE(gamma, lambda) runs over
    the critic's `values` (N, T), the returns A + V (before whitening) are the critic's regression targets, and
    the advantages are whitened over the batch's loss tokens when advantage.whiten."""
    if cfg.advantage.type != "gae":
        raise ValueError(f"gae_targets needs algorithm.advantage.type=gae, got {cfg.advantage.type!r}")
    if values is None:
        raise ValueError(
            "algorithm.advantage.type=gae needs the critic's per-token `values` (N, T) in compute_advantages; "
            "enable the critic (critic.num_workers=1) or choose a critic-free estimator (e.g. preset grpo)."
        )
    mask = loss_mask.bool()
    beta = cfg.kl.beta if kl_in_reward(cfg) else 0.0
    if beta > 0 and kl is None:
        raise ValueError(f"algorithm.kl.placement=reward with beta={cfg.kl.beta} needs the per-token `kl`")
    token_rewards = token_level_rewards(rewards.to(torch.float32), mask, kl, beta)
    adv, returns = gae_advantage(token_rewards, values, mask, cfg.advantage.gamma, cfg.advantage.lam)
    if cfg.advantage.whiten:
        adv = masked_whiten(adv, mask)
    return torch.where(mask, adv, 0.0), returns


# ------------------------------------------------------------------------------------------ micro-batch side


@dataclass
class PolicyLossInputs:
    """One micro-batch; tensors (B, T). Masked positions may hold anything finite or not: they are selected out."""

    behavior_logprobs: Tensor
    """mu, recorded by vLLM at sampling time."""
    advantages: Tensor
    """From compute_advantages, sharded like the batch."""
    loss_mask: Tensor
    """bool, True on response tokens that are trained on."""
    proximal_logprobs: Tensor | None = None
    """Learner's log-probs before the update (decoupled mode)."""
    ref_logprobs: Tensor | None = None
    """Frozen reference policy (KL in the loss; logged when given)."""
    entropy: Tensor | None = None
    """Per-token entropy of the current policy, with grad when entropy_coef > 0 (entropy_from_logits)."""
    sequence_mean: Callable[[Tensor], Tensor] | None = None
    """With sequence_lengths: maps per-token values (B, T), 0 off-mask, to the mean over each position's whole
    sequence (every slice of it, e.g. an all-reduce over the SP group), differentiable. GSPO's sequence ratio
    and sequence-level off-policy masks use it. None: a row's mean over its own mask."""
    sequence_lengths: Tensor | None = None
    """|y_i| (loss tokens of the whole sequence) at each position, when a row holds several sequences or a slice
    of one (sequence parallelism): seq_mean_token_mean divides by it (see aggregate_loss). None: one sequence per
    row, counted from loss_mask."""
    teacher_topk_logprobs: Tensor | None = None
    """(B, T, k) the teacher's log-probs of its k most likely ids at each position (algorithm.distillation.top_k):
    with `topk_logprobs`, the top-k distillation loss (learner/distillation.py topk_forward_kl)."""
    topk_logprobs: Tensor | None = None
    """(B, T, k) the current policy's log-probs of those same ids, with grad (learner/batch.py score_responses_at,
    in the forward that computes `logprobs`)."""


def compute_policy_loss(logprobs: Tensor, inputs: PolicyLossInputs, cfg: AlgorithmConfig,
                        normalizer: LossNormalizer) -> tuple[Tensor, dict[str, float]]:
    """logprobs (B, T) current policy, with grad. Returns the micro-batch's share of the global loss: summing the
    returned losses over all micro-batches and ranks gives the global loss exactly (and the gradient). Metrics are
    SUMS (plus counts `num_tokens`, `num_sequences`) to add across micro-batches and ranks; keys ending in `_max`
    combine by max. Pass the combined dict to finalize_metrics.

    Per token: l = w * pg_loss(logprobs, old_logprobs, A) + beta * KL (placement loss) - entropy_coef * H
    + lambda * KL_topk(teacher || pi) (algorithm.distillation.top_k > 0, lambda its weight), where old_logprobs =
    proximal (decoupled) or mu (bypass) and w is the behavior weight (off_policy.py). The IS weight and mask act
    on the policy-gradient term only; dropped tokens still count in the normalizer."""
    mask = inputs.loss_mask.bool()
    lp = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device))
    mu = torch.where(mask, inputs.behavior_logprobs.detach().to(lp.dtype), 0.0)
    adv = torch.where(mask, inputs.advantages.detach().to(lp.dtype), 0.0)
    off, pl = cfg.off_policy, cfg.policy_loss

    if off.mode == "decoupled":
        if inputs.proximal_logprobs is None:
            raise ValueError(
                "algorithm.off_policy.mode=decoupled needs PolicyLossInputs.proximal_logprobs (the learner's "
                "log-probs before the update, see needs_proximal_logprobs); recompute them or set mode=bypass."
            )
        old = torch.where(mask, inputs.proximal_logprobs.detach().to(lp.dtype), 0.0)
        weights, keep, metrics = behavior_weights(old - mu, mask, off.tis_cap, off.mask_low, off.mask_high,
                                                  off.mask_level, truncate=True, sequence_mean=inputs.sequence_mean)
    else:  # bypass: mu is the old policy; the loss's own ratio is the IS weight, except for REINFORCE
        old = mu
        is_reinforce = pl.type == "reinforce"
        weights, keep, metrics = behavior_weights(lp.detach() - mu, mask, off.tis_cap, off.mask_low,
                                                  off.mask_high, off.mask_level, truncate=is_reinforce,
                                                  sequence_mean=inputs.sequence_mean)
        if not is_reinforce:
            weights = keep.to(lp.dtype)

    kwargs = {k: v for k, v in pl.model_dump().items() if k != "type"}
    if pl.type == "gspo" and inputs.sequence_mean is not None:
        kwargs["sequence_mean"] = inputs.sequence_mean
    pg, pg_metrics = POLICY_LOSSES[pl.type](lp, old, adv, mask, **kwargs)
    metrics.update(pg_metrics)
    pg = pg * weights.to(pg.dtype)
    metrics["pg_loss"] = float(torch.where(mask, pg.detach(), 0.0).sum())
    total = pg

    if inputs.ref_logprobs is not None or cfg.kl.beta > 0:
        if inputs.ref_logprobs is None:
            raise ValueError(
                f"algorithm.kl.beta={cfg.kl.beta} needs PolicyLossInputs.ref_logprobs (see needs_ref_logprobs); "
                "load the reference model or set algorithm.kl.beta=0."
            )
        ref = torch.where(mask, inputs.ref_logprobs.detach().to(lp.dtype), 0.0)
        kl_t = kl_estimate(lp, ref, cfg.kl.estimator)
        metrics["kl"] = float(torch.where(mask, kl_t.detach(), 0.0).sum())
        if cfg.kl.beta > 0 and cfg.kl.placement == "loss":
            total = total + cfg.kl.beta * kl_t

    if inputs.entropy is not None:
        ent = torch.where(mask, inputs.entropy.to(lp.dtype), 0.0)
        metrics["entropy"] = float(ent.detach().sum())
        if cfg.entropy_coef > 0:
            if logprobs.requires_grad and not inputs.entropy.requires_grad:
                raise ValueError(
                    f"algorithm.entropy_coef={cfg.entropy_coef} needs PolicyLossInputs.entropy computed with grad "
                    "(entropy_from_logits(logits) outside torch.no_grad), else the bonus has no effect; "
                    "compute it with grad or set algorithm.entropy_coef=0."
                )
            total = total - cfg.entropy_coef * ent
    elif cfg.entropy_coef > 0:
        raise ValueError(
            f"algorithm.entropy_coef={cfg.entropy_coef} needs PolicyLossInputs.entropy with grad "
            "(entropy_from_logits(logits)); pass it or set algorithm.entropy_coef=0."
        )

    if inputs.teacher_topk_logprobs is not None or cfg.distillation.top_k:
        if inputs.teacher_topk_logprobs is None or inputs.topk_logprobs is None:
            raise ValueError(
                f"algorithm.distillation.top_k={cfg.distillation.top_k} needs PolicyLossInputs.teacher_topk_logprobs "
                "(streamed by teacher workers) and topk_logprobs (the policy's log-probs of the teacher's ids, "
                "learner/batch.py score_responses_at); pass both, or set algorithm.distillation.top_k=0")
        distill = topk_forward_kl(inputs.topk_logprobs, inputs.teacher_topk_logprobs, mask).to(lp.dtype)
        metrics["teacher/topk_kl"] = float(distill.detach().sum())
        total = total + cfg.distillation.weight * distill

    loss = aggregate_loss(total, mask, cfg.aggregation, normalizer, inputs.sequence_lengths)
    metrics["loss"] = float(loss.detach())
    metrics["num_tokens"] = float(mask.sum())
    metrics["num_sequences"] = float(mask.any(dim=1).sum())
    return loss, metrics


_RENAMES = {"ratio": "ratio_mean", "is_weight": "is_weight_mean", "is_truncated": "is_truncated_frac",
            "is_masked": "is_masked_frac"}
_KEEP = {"num_tokens", "num_sequences", "loss"}


def finalize_metrics(summed: dict[str, float]) -> dict[str, float]:
    """Turn summed metrics into means. Per-token sums are divided by num_tokens (clip_frac*, ratio_mean, kl,
    entropy, pg_loss, is_weight_mean, is_truncated_frac, is_masked_frac, behavior_kl_k3); `_max` keys, counts and
    `loss` (already the global loss) are kept; is_ess = (sum w)^2 / (num_tokens * sum w^2) is derived."""
    n = summed.get("num_tokens", 0.0)
    out: dict[str, float] = {}
    for key, value in summed.items():
        if key in _KEEP or key.startswith("learner/"):  # learner/*: counts and ratios the learner reports as is
            out[key] = value
        elif merges_by_max(key):
            out[key] = value if n > 0 else 0.0
        elif key == "is_weight_sq":
            continue
        else:
            out[_RENAMES.get(key, key)] = value / n if n > 0 else 0.0
    if "is_weight" in summed and "is_weight_sq" in summed:
        sq = summed["is_weight_sq"]
        out["is_ess"] = summed["is_weight"] ** 2 / (n * sq) if n > 0 and sq > 0 else 1.0
    return out
