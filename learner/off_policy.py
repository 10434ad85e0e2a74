"""Off-policy correction for asynchronous data: behavior weights w = pi_prox / mu, truncation (TIS) and masking.

Trajectories carry mu = behavior_logprobs recorded by vLLM (possibly several policy versions old, and never
bit-identical to the learner's numerics). See `behavior_weights` for the two modes and ALGORITHMS.md for defaults.
"""

from collections.abc import Callable

import torch
from torch import Tensor

_LOG_W_CLAMP = 20.0


def behavior_weights(log_weights: Tensor, loss_mask: Tensor, tis_cap: float | None = None,
                     mask_low: float | None = None, mask_high: float | None = None,
                     mask_level: str = "token", truncate: bool = True,
                     sequence_mean: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Importance weights w = exp(log_weights) per token, (B, T), where log_weights = log pi_prox - log mu
    (decoupled PPO, Fu et al. 2025, AReaL, arXiv 2505.24298, eq. 5) or log pi_theta - log mu detached (bypass).

    Truncation (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"):
    w <- min(w, tis_cap), applied only if `truncate`. Masking: tokens whose w leaves [mask_low, mask_high] are dropped
    (mask_level="token"), or whole sequences whose geometric-mean weight exp(mean_t log w) leaves it ("sequence";
    `sequence_mean` takes that mean over whole sequences when a row holds several or a slice of one).

    Returns (weights (B, T) detached, 0 where dropped or off-mask; keep (B, T) bool, loss_mask minus the dropped
    tokens; metric sums over loss tokens: is_weight, is_weight_sq (raw w, for ESS = (sum w)^2 / (N sum w^2)),
    is_weight_max, is_truncated, is_masked, behavior_kl_k3 (the k3 estimate of KL(mu || pi_prox) per token))."""
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=log_weights.device)
    log_w = torch.where(mask, log_weights.detach().float(), zero).clamp(-_LOG_W_CLAMP, _LOG_W_CLAMP)
    w = torch.exp(log_w)
    keep = mask.clone()
    if mask_low is not None or mask_high is not None:
        if mask_level == "sequence":
            if sequence_mean is None:
                seq_w = torch.exp(log_w.sum(dim=1) / mask.sum(dim=1).clamp(min=1))[:, None].expand_as(w)
            else:
                seq_w = torch.exp(sequence_mean(log_w)).expand_as(w)
        elif mask_level == "token":
            seq_w = w
        else:
            raise ValueError(f"algorithm.off_policy.mask_level={mask_level!r} must be 'token' or 'sequence'.")
        if mask_low is not None:
            keep &= seq_w >= mask_low
        if mask_high is not None:
            keep &= seq_w <= mask_high
    applied = w
    truncated = torch.zeros_like(mask)
    if truncate and tis_cap is not None:
        truncated = mask & (w > tis_cap)
        applied = w.clamp(max=tis_cap)
    applied = torch.where(keep, applied, zero)
    metrics = {
        "is_weight": float(torch.where(mask, w, zero).sum()),
        "is_weight_sq": float(torch.where(mask, w * w, zero).sum()),
        "is_weight_max": float(w[mask].max()) if bool(mask.any()) else float("-inf"),
        "is_truncated": float((truncated & keep).sum()),
        "is_masked": float((mask & ~keep).sum()),
        # mu samples, r = pi_prox / mu: KL(mu || pi_prox) ~ E_mu[r - 1 - log r]
        "behavior_kl_k3": float(torch.where(mask, torch.expm1(log_w) - log_w, zero).sum()),
    }
    return applied, keep, metrics


def effective_sample_size(weights: Tensor, loss_mask: Tensor) -> float:
    """Normalized ESS = (sum w)^2 / (N sum w^2) over the N loss tokens: 1 when all weights are equal, 1/N when one
    token carries all the weight. Across micro-batches, combine the sums (see objective.finalize_metrics)."""
    mask = loss_mask.bool()
    w = weights.detach().float()[mask]
    if w.numel() == 0 or float((w * w).sum()) == 0.0:
        return 1.0
    return float(w.sum() ** 2 / (w.numel() * (w * w).sum()))
