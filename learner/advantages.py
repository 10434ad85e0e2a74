"""Advantage estimators: from per-sample rewards (and optionally per-token KL or critic values) to per-token
advantages (N, T). Pure torch. Rows are group-contiguous: rows [g*G:(g+1)*G] are the G samples of one prompt.

Group estimators give an all-equal group exactly 0 (no NaN), whatever the std convention or eps.
"""

import torch
from torch import Tensor


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must divide the number of samples N={rewards.numel()}: the batch must hold "
            "whole groups, in group-contiguous order."
        )
    return rewards.reshape(-1, group_size)


def zero_variance_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(num_groups,) bool: True where every reward of the group is identical (no learning signal; DAPO filters
    them under dynamic sampling). Exact comparison, so groups like [0.1, 0.1, 0.1] count whatever the rounding."""
    g = _groups(rewards, group_size)
    return g.amax(dim=1) == g.amin(dim=1)


def _guard(adv: Tensor, rewards: Tensor, group_size: int) -> Tensor:
    """Exact zeros for all-equal groups (a mean of equal floats need not equal them bit for bit; std may be 0)."""
    flat = zero_variance_groups(rewards, group_size).repeat_interleave(group_size)
    return torch.where(flat, torch.zeros_like(adv), adv)


def reinforce_advantage(rewards: Tensor) -> Tensor:
    """A_i = R_i (Williams 1992, eq. 11: the raw return, no baseline). (N,) -> (N,)."""
    return rewards.clone()


def group_mean_advantage(rewards: Tensor, group_size: int) -> Tensor:
    """A_i = R_i - mean_j R_j over the group. Also Dr.GRPO's advantage (Liu et al. 2025, eq. 3: GRPO without the
    std division, which biases towards too-easy and too-hard questions). (N,) -> (N,)."""
    g = _groups(rewards, group_size)
    adv = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    return _guard(adv, rewards, group_size)


def rloo_advantage(rewards: Tensor, group_size: int) -> Tensor:
    """A_i = R_i - 1/(G-1) sum_{j != i} R_j, leave-one-out baseline (Ahmadian et al. 2024, eq. 8; Kool et al. 2019).
    Equals G/(G-1) * (R_i - mean). Unbiased: the baseline does not depend on sample i. (N,) -> (N,)."""
    if group_size < 2:
        raise ValueError(
            f"algorithm.advantage.type=rloo needs group_size >= 2, got {group_size}: the leave-one-out baseline "
            "averages the other samples of the group. Raise the group size or use type=reinforce."
        )
    g = _groups(rewards, group_size)
    others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return _guard((g - others).reshape(-1), rewards, group_size)


def grpo_advantage(rewards: Tensor, group_size: int, std: str = "sample", eps: float = 1e-6) -> Tensor:
    """A_i = (R_i - mean) / (std + eps) over the group (Shao et al. 2024, DeepSeekMath, section 4.1.2, outcome
    supervision). std="sample" divides squared deviations by G-1 (torch.std default, TRL, verl), "population" by G.
    A group of one sample, or of equal rewards, gets exactly 0. (N,) -> (N,)."""
    if std not in ("sample", "population"):
        raise ValueError(f"algorithm.advantage.std={std!r} must be 'sample' or 'population'.")
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    dof = group_size - 1 if std == "sample" else group_size
    sd = (centred.pow(2).sum(dim=1, keepdim=True) / max(dof, 1)).sqrt()
    adv = (centred / (sd + eps)).reshape(-1)
    return _guard(adv, rewards, group_size)


def broadcast_to_tokens(seq_advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """(N,) -> (N, T): every loss token of a sequence gets its sequence's advantage; 0 elsewhere."""
    adv = seq_advantages.to(torch.float32)[:, None].expand(loss_mask.shape)
    return torch.where(loss_mask.bool(), adv, torch.zeros_like(adv))


def token_level_rewards(rewards: Tensor, loss_mask: Tensor, kl: Tensor | None = None, beta: float = 0.0) -> Tensor:
    """(N, T) rewards: R on each sequence's last loss token, minus beta * kl on every loss token (PPO-RLHF,
    Ouyang et al. 2022, eq. 2; Stiennon et al. 2020). A sequence with no loss token gets none of R."""
    mask = loss_mask.bool()
    n, t = mask.shape
    idx = torch.arange(t, device=mask.device).expand(n, t)
    last = torch.where(mask, idx, torch.full_like(idx, -1)).amax(dim=1)  # -1 when empty
    out = torch.zeros(n, t, dtype=torch.float32, device=mask.device)
    has = last >= 0
    out[has.nonzero(as_tuple=True)[0], last[has]] = rewards.to(torch.float32)[has]
    if kl is not None and beta != 0.0:
        out = out - beta * torch.where(mask, kl.to(torch.float32), torch.zeros_like(out))
    return out


def returns_to_go(token_rewards: Tensor, loss_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """G_t = sum_{s >= t, s unmasked} gamma^(k) r_s over the following loss tokens. (N, T) -> (N, T), 0 off-mask."""
    mask = loss_mask.bool()
    out = torch.zeros_like(token_rewards, dtype=torch.float32)
    running = torch.zeros(token_rewards.shape[0], dtype=torch.float32, device=token_rewards.device)
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m, token_rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, torch.zeros_like(running))
    return out


def masked_whiten(x: Tensor, loss_mask: Tensor, eps: float = 1e-8, shift_mean: bool = True) -> Tensor:
    """(x - mean) / (std + eps) over the unmasked entries (population std); 0 off-mask. If all unmasked entries are
    equal (std 0) the result is exactly 0 (or x unchanged when shift_mean=False)."""
    mask = loss_mask.bool()
    n = mask.sum().clamp(min=1)
    xm = torch.where(mask, x, torch.zeros_like(x))
    mean = xm.sum() / n
    var = torch.where(mask, (x - mean) ** 2, torch.zeros_like(x)).sum() / n
    sd = var.sqrt()
    centred = x - mean if shift_mean else x
    out = torch.where(sd > 0, centred / (sd + eps), torch.zeros_like(x) if shift_mean else x)
    return torch.where(mask, out, torch.zeros_like(out))


def reinforce_pp_advantage(rewards: Tensor, loss_mask: Tensor, group_size: int, group_baseline: bool = False,
                           kl: Tensor | None = None, beta: float = 0.0, eps: float = 1e-8) -> Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262, sections 3.1-3.2): per-token return-to-go of the KL-shaped token
    rewards (gamma = 1), normalized over all loss tokens of the global batch: A = (G_t - mean) / std.
    group_baseline=True is REINFORCE++-baseline: R - group mean first, then divided by the batch std only (the
    group baseline already centres; re-centring would give all-equal groups a non-zero advantage). (N, T)."""
    if group_baseline:
        rewards = group_mean_advantage(rewards, group_size)
    g = returns_to_go(token_level_rewards(rewards, loss_mask, kl, beta), loss_mask)
    return masked_whiten(g, loss_mask, eps=eps, shift_mean=not group_baseline)


def gae_advantage(token_rewards: Tensor, values: Tensor, loss_mask: Tensor, gamma: float = 1.0,
                  lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv 1506.02438, eq. 16):
    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = sum_l (gamma lam)^l delta_{t+l},  with V = 0 after the last token.
    Masked positions are skipped (the next value is the next loss token's). Returns (advantages, returns = A + V),
    both (N, T) and 0 off-mask; the returns are the critic's regression targets."""
    mask = loss_mask.bool()
    values = torch.where(mask, values.to(torch.float32), torch.zeros_like(values, dtype=torch.float32))
    n, t_len = mask.shape
    adv = torch.zeros(n, t_len, dtype=torch.float32, device=values.device)
    next_value = torch.zeros(n, dtype=torch.float32, device=values.device)
    last_gae = torch.zeros_like(next_value)
    for t in range(t_len - 1, -1, -1):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(m, gae, torch.zeros_like(gae))
        last_gae = torch.where(m, gae, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
    returns = torch.where(mask, adv + values, torch.zeros_like(adv))
    return adv, returns
