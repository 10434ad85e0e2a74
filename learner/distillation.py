"""On-policy distillation: the teacher's per-token learning signal, mixed with the verifier's advantage.

The student samples y ~ mu (the behavior policy vLLM sampled with); a frozen teacher scores every sampled token
(teacher workers, Trajectory.teacher_logprobs). The reverse KL to the teacher, KL(pi || pi_T) =
E_{y ~ pi}[sum_t log pi(y_t | y_<t) - log pi_T(y_t | y_<t)], is minimized by the policy gradient whose per-token
reward is r_t = -(log pi(y_t) - log pi_T(y_t)) with no discounting across tokens (each token is scored on its own):
Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes" (GKD,
ICLR), eq. 2 with the reverse KL as the divergence; Thinking Machines, "On-Policy Distillation" (Lu and Thinking
Machines Lab, Oct 2025), whose advantage is -(log p_sampler - log p_teacher) per token.

As in that post, the student's log-prob in the advantage is the sampler's, mu: it is known before the update, and
the importance-ratio correction every relayrl loss applies (learner/off_policy.py, learner/policy_losses.py)
accounts for the difference between mu and the policy being trained.

With algorithm.distillation.top_k = k > 0 the teacher ships its k most likely tokens at every position instead of
one sampled token's log-prob, and the loss adds, per sampled position, the forward KL from the teacher's top-k
(renormalized) to the student, topk_forward_kl: a dense, exact per-position loss with no sampling noise in the
teacher's signal (the GKD objective on student-generated sequences, Agarwal et al. 2024, with the forward KL as
the divergence on the teacher's top-k support; learner/ALGORITHMS.md says why forward). Pure torch, no Ray.
"""

import torch
from torch import Tensor


def reverse_kl_per_token(behavior_logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """(B, T) float32: log mu(y_t) - log pi_T(y_t) on the loss tokens, 0 elsewhere. Its mean over the tokens
    sampled from mu is the k1 estimate of KL(mu || pi_T) per token."""
    mask = loss_mask.bool()
    diff = behavior_logprobs.detach().float() - teacher_logprobs.detach().float()
    return torch.where(mask, diff, torch.zeros_like(diff))


def teacher_advantages(behavior_logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """(B, T) float32: A_t = -(log mu(y_t) - log pi_T(y_t)) on the loss tokens, 0 elsewhere. Positive where the
    teacher likes the sampled token more than the student did, negative where less."""
    return -reverse_kl_per_token(behavior_logprobs, teacher_logprobs, loss_mask)


def mix_advantages(reward_advantages: Tensor, teacher_adv: Tensor, weight: float) -> Tensor:
    """(B, T): weight * teacher_adv + (1 - weight) * reward_advantages (algorithm.distillation.weight). Weight 1 is
    pure distillation, 0 pure RL. Both inputs are 0 off the loss tokens, so the result is too."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"algorithm.distillation.weight={weight} must lie in [0, 1]")
    if weight == 0.0:
        return reward_advantages
    if weight == 1.0:
        return teacher_adv
    return weight * teacher_adv + (1.0 - weight) * reward_advantages


def topk_forward_kl(logprobs_at: Tensor, teacher_topk_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """(B, T) float32: sum_j p_T(j) (log p_T(j) - log pi(j)) over the teacher's top-k ids j at each loss token, 0
    elsewhere, where p_T is the teacher's top-k renormalized to sum to 1 and log pi the student's log-softmax over
    the whole vocabulary at those ids (`logprobs_at` (B, T, k), with grad; `teacher_topk_logprobs` (B, T, k)).

    It is the cross-entropy from p_T to pi minus p_T's entropy, so it is >= 0 and 0 only when the student puts the
    teacher's renormalized probabilities on the k ids (and so all its mass on them). Its gradient with respect to
    the student's logits z at a position is pi - p_T (p_T = 0 off the top k): it raises the logits of the ids the
    teacher prefers more than the student does and lowers every other one, the student's own mass outside the
    teacher's top k included."""
    mask = loss_mask.bool()
    teacher = teacher_topk_logprobs.detach().float()
    teacher = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    per_id = teacher.exp() * (teacher - logprobs_at.float())
    per_token = per_id.sum(dim=-1)
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))


def topk_mass(teacher_topk_logprobs: Tensor, loss_mask: Tensor) -> float:
    """Mean over the loss tokens of the teacher's probability mass on its top k (1: the k ids hold all of it; far
    below 1: the renormalized top-k is a poor stand-in for the teacher, raise algorithm.distillation.top_k)."""
    mask = loss_mask.bool()
    if not bool(mask.any()):
        return 0.0
    return float(teacher_topk_logprobs.detach().float().exp().sum(dim=-1)[mask].mean())


def _quarter_means(values: Tensor, loss_mask: Tensor) -> list[float]:
    """Mean of `values` over the loss tokens in each quarter of the sampled tokens' positions, per sample: the
    k-th loss token of a sample with n of them falls in quarter floor(4k / n)."""
    mask = loss_mask.bool()
    rank = torch.cumsum(mask.long(), dim=1) - 1
    count = mask.sum(dim=1, keepdim=True).clamp(min=1)
    quarter = torch.div(4 * rank, count, rounding_mode="floor").clamp(0, 3)
    out = []
    for q in range(4):
        sel = mask & (quarter == q)
        out.append(float(values[sel].mean()) if bool(sel.any()) else 0.0)
    return out


def distillation_metrics(behavior_logprobs: Tensor, teacher_logprobs: Tensor, loss_mask: Tensor,
                         reward_advantages: Tensor, weight: float) -> dict[str, float]:
    """teacher/*: the per-token reverse KL to the teacher over the sampled tokens (mean, quantiles, and the mean in
    each quarter of the response's positions: does the student drift from the teacher early or late?), and the
    share of the advantage's magnitude that comes from the teacher, sum |w A_T| / (sum |w A_T| + sum |(1-w) A_R|)."""
    mask = loss_mask.bool()
    kl = reverse_kl_per_token(behavior_logprobs, teacher_logprobs, mask)
    tokens = kl[mask]
    if tokens.numel() == 0:
        return {}
    q = torch.quantile(tokens, torch.tensor([0.5, 0.9, 0.99]))
    from_teacher = (weight * kl.abs()).sum()
    from_reward = ((1.0 - weight) * reward_advantages.float().abs() * mask).sum()
    total = float(from_teacher + from_reward)
    out = {
        "teacher/reverse_kl_mean": float(tokens.mean()),
        "teacher/reverse_kl_p50": float(q[0]),
        "teacher/reverse_kl_p90": float(q[1]),
        "teacher/reverse_kl_p99": float(q[2]),
        "teacher/advantage_share": float(from_teacher) / total if total > 0 else 0.0,
    }
    for i, mean in enumerate(_quarter_means(kl, mask)):
        out[f"teacher/reverse_kl_q{i + 1}"] = mean
    return out
