"""The critic's objective: the clipped value loss of PPO, per token, summed with a global normalizer so any split
of the batch over micro-batches and critic ranks gives the same loss and gradient. Pure torch.

Used by actors/critic_worker.py (one DeepSpeed critic rank); the targets come from learner/advantages.gae_advantage.
"""

import torch
from torch import Tensor


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor,
                       clip: float | None, num_tokens: float) -> tuple[Tensor, dict[str, float]]:
    """values (B, T) with grad, old_values (B, T) stamped at sampling time, returns (B, T) GAE targets,
    loss_mask (B, T) bool. Per token (Schulman et al. 2017, PPO, eq. 9's L^VF = (V - V_targ)^2, with the clip
    of OpenAI baselines ppo2, Dhariwal et al. 2017):

        V_clip = V_old + clip(V - V_old, -clip, +clip)
        l_t    = 1/2 * max((V - R)^2, (V_clip - R)^2)

    so once V has moved more than `clip` away from V_old in the direction that lowers the error, the gradient
    stops (a trust region for the critic). clip=None: l_t = 1/2 (V - R)^2. Returns (sum over loss tokens of l_t
    / num_tokens, metric SUMS over this micro-batch's loss tokens: value_loss, value_clip_frac (tokens where the
    clipped error was the larger one), values, returns, value_error_sq (for explained variance), num_tokens).
    num_tokens is the global batch's count of loss tokens, so the parts add up to the token mean."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens={num_tokens} must be > 0: the global batch has no loss token to fit")
    mask = loss_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    old = torch.where(mask, old_values.detach().to(values.dtype), zero)
    ret = torch.where(mask, returns.detach().to(values.dtype), zero)
    err = (v - ret) ** 2
    if clip is None:
        per_token = 0.5 * err
        clipped_frac = torch.zeros_like(err)
    else:
        v_clip = old + (v - old).clamp(-clip, clip)
        err_clip = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clipped_frac = (err_clip > err).to(err.dtype)
    per_token = torch.where(mask, per_token, zero)
    loss = per_token.sum() / num_tokens
    metrics = {
        "value_loss": float(per_token.detach().sum()) / num_tokens,
        "value_clip_frac": float(torch.where(mask, clipped_frac, zero).sum()),
        "values": float(v.detach().sum()),
        "returns": float(ret.sum()),
        "value_error_sq": float(torch.where(mask, err.detach(), zero).sum()),
        "num_tokens": float(mask.sum()),
    }
    return loss, metrics


def finalize_value_metrics(summed: dict[str, float], returns_var: float) -> dict[str, float]:
    """Summed metrics of every micro-batch and rank -> `critic/*` means. `value_loss` is already the token mean
    (its parts were divided by the global count). explained_variance = 1 - mean (V - R)^2 / Var(R), with
    Var(R) over the batch's loss tokens (computed by the caller, who holds the whole batch); 1 is a perfect
    critic, 0 no better than the mean return."""
    n = summed.get("num_tokens", 0.0)
    out = {"critic/value_loss": summed.get("value_loss", 0.0)}
    if n > 0:
        out["critic/value_clip_frac"] = summed.get("value_clip_frac", 0.0) / n
        out["critic/values_mean"] = summed.get("values", 0.0) / n
        out["critic/returns_mean"] = summed.get("returns", 0.0) / n
        mse = summed.get("value_error_sq", 0.0) / n
        out["critic/explained_variance"] = 1.0 - mse / returns_var if returns_var > 0 else 0.0
    for key in ("critic/grad_norm_max", "critic/lr", "critic/version", "critic/seconds_max"):
        if key in summed:
            out[key] = summed[key]
    if "critic/skipped_nonfinite_max" in summed:  # each rank's running count, the same on every rank
        out["critic/skipped_nonfinite"] = summed["critic/skipped_nonfinite_max"]
    return out
