"""Per-token policy losses: PPO clip (+ clip-higher, dual-clip), GSPO, CISPO, REINFORCE.

Each takes (B, T) tensors whose masked positions are already finite (objective.py fills them with 0) and returns
(per_token_loss (B, T), metric sums). Aggregation over tokens is learner/aggregation.py's job; off-policy weights
are applied by the caller. `old_logprobs` is the proximal policy (decoupled mode) or mu (bypass mode).
"""

from collections.abc import Callable

import torch
from torch import Tensor

_LOG_RATIO_CLAMP = 20.0


def _ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return torch.exp((logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))


def _msum(x: Tensor, mask: Tensor) -> float:
    return float(torch.where(mask, x.detach().float(), torch.zeros((), device=x.device)).sum())


def _mmax(x: Tensor, mask: Tensor) -> float:
    if not bool(mask.any()):
        return float("-inf")
    return float(x.detach().float()[mask].max())


def ppo_clip_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                  eps_low: float = 0.2, eps_high: float = 0.2,
                  dual_clip_c: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate, per token (Schulman et al. 2017, arXiv 1707.06347, eq. 7), asymmetric band
    [1 - eps_low, 1 + eps_high] (DAPO clip-higher, Yu et al. 2025, eq. 10) and optional dual-clip for A < 0
    (Ye et al. 2020, arXiv 1912.09729, eq. 5):
        r = exp(logprobs - old_logprobs)
        loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A);   if A < 0 and dual-clip: loss = min(loss, -c A)
    The gradient is zero where the clipped term wins: A > 0 with r > 1 + eps_high, A < 0 with r < 1 - eps_low,
    and A < 0 with r > c under dual-clip."""
    mask = loss_mask.bool()
    ratio = _ratio(logprobs, old_logprobs)
    surr = ratio * advantages
    surr_clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(surr, surr_clipped)
    r = ratio.detach()
    clipped_high = (advantages > 0) & (r > 1.0 + eps_high)
    clipped_low = (advantages < 0) & (r < 1.0 - eps_low)
    metrics = {
        "clip_frac": _msum((clipped_high | clipped_low).float(), mask),
        "clip_frac_high": _msum(clipped_high.float(), mask),
        "clip_frac_low": _msum(clipped_low.float(), mask),
    }
    if dual_clip_c is not None:
        bound = -dual_clip_c * advantages
        dual = (advantages < 0) & (loss.detach() > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
        metrics["dual_clip_frac"] = _msum(dual.float(), mask)
    metrics.update(ratio=_msum(r, mask), ratio_max=_mmax(r, mask))
    return loss, metrics


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """(B, T) -> (B,): mean over unmasked tokens of (logprobs - old_logprobs); 0 for a sequence with no token.
    exp of it is GSPO's length-normalized sequence ratio (pi(y)/pi_old(y))^(1/|y|)."""
    mask = loss_mask.bool()
    diff = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    return diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def gspo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
              eps_low: float = 3e-4, eps_high: float = 4e-4,
              sequence_mean: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eq. 5-7): sequence ratio
        s_i = exp(1/|y_i| sum_t (logprobs - old_logprobs)),   loss = -min(s_i A, clip(s_i, 1 - eps_low, 1 + eps_high) A)
    computed per sequence and written on each of its loss tokens (A is per token, constant within a sequence for
    outcome rewards). With seq_mean_token_mean aggregation this is the paper's objective exactly; a clipped sequence
    gets no gradient on any of its tokens. Clip metrics count tokens of clipped sequences.

    sequence_mean: for rows holding several sequences or a slice of one (sequence parallelism), maps per-token
    values (B, T), 0 off-mask, to the mean over each position's whole sequence (differentiable; see
    objective.PolicyLossInputs.sequence_mean). None: each row is one sequence."""
    mask = loss_mask.bool()
    if sequence_mean is None:
        seq_lr = sequence_log_ratio(logprobs, old_logprobs, mask)[:, None]
    else:
        seq_lr = sequence_mean(torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs)))
    s = torch.exp(seq_lr.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).expand_as(logprobs)
    surr = s * advantages
    surr_clipped = s.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(surr, surr_clipped)
    r = s.detach()
    clipped_high = (advantages > 0) & (r > 1.0 + eps_high)
    clipped_low = (advantages < 0) & (r < 1.0 - eps_low)
    return loss, {
        "clip_frac": _msum((clipped_high | clipped_low).float(), mask),
        "clip_frac_high": _msum(clipped_high.float(), mask),
        "clip_frac_low": _msum(clipped_low.float(), mask),
        "ratio": _msum(r, mask),
        "ratio_max": _mmax(r, mask),
    }


def cispo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
               eps_low: float = 1.0, eps_high: float = 1.0) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax 2025, MiniMax-M1, arXiv 2506.13585, eq. 4-5):
        loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs,   r = exp(logprobs - old_logprobs)
    The importance weight is clipped and detached; every token keeps the gradient -w A grad(log pi), so tokens far
    outside the band (often rare "fork" tokens) still learn. `clip_frac` counts tokens whose weight was clipped."""
    mask = loss_mask.bool()
    r = _ratio(logprobs, old_logprobs).detach()
    w = r.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = -w * advantages * logprobs
    high, low = r > 1.0 + eps_high, r < 1.0 - eps_low
    return loss, {
        "clip_frac": _msum((high | low).float(), mask),
        "clip_frac_high": _msum(high.float(), mask),
        "clip_frac_low": _msum(low.float(), mask),
        "ratio": _msum(r, mask),
        "ratio_max": _mmax(r, mask),
    }


def reinforce_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                   loss_mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE (Williams 1992, eq. 11): loss = -A * logprobs, gradient -A grad(log pi). No ratio and no clip;
    the off-policy weight (objective.py) is its only correction. The ratio to old_logprobs is only logged."""
    mask = loss_mask.bool()
    r = _ratio(logprobs, old_logprobs).detach()
    return -advantages * logprobs, {"ratio": _msum(r, mask), "ratio_max": _mmax(r, mask)}


POLICY_LOSSES = {"ppo_clip": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss, "reinforce": reinforce_loss}
"""Loss functions by `algorithm.policy_loss.type`."""
