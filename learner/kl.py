"""KL to the reference policy and the policy's entropy, per token.

KL estimators follow Schulman, "Approximating KL divergence" (2020, joschu.net/blog/kl-approx.html): with tokens
sampled from pi and r = ref(x) / pi(x), each estimates KL(pi || ref) = E_pi[log pi - log ref].
"""

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps k2/k3 finite when a token is very unlikely under one policy


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(pi || ref) estimate, (B, T) -> (B, T), differentiable through `logprobs`.
    k1 = -log r (unbiased, high variance, can be negative);
    k2 = (log r)^2 / 2 (biased, low variance, its gradient is the true KL gradient's for small divergence);
    k3 = (r - 1) - log r (unbiased, always >= 0 because log r <= r - 1; GRPO's choice, Shao et al. 2024 eq. 4).
    The log-ratio is clamped to [-20, 20]. Fill masked positions with anything finite; mask them afterwards."""
    log_r = (ref_logprobs - logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.pow(2)
    if estimator == "k3":
        return torch.expm1(log_r) - log_r  # expm1 keeps k3 >= 0 and accurate when r is close to 1
    raise ValueError(f"algorithm.kl.estimator={estimator!r} must be one of 'k1', 'k2', 'k3'.")


def _entropy_chunk(chunk: Tensor) -> Tensor:
    z = chunk.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_from_logits(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """Per-token entropy H = logsumexp(z) - sum softmax(z) * z of the categorical given by logits (B, T, V) -> (B, T).
    Computed in float32 over chunks of `chunk_size` positions along T, so the extra memory is
    O(B * chunk_size * V) rather than O(B * T * V); with grad, each chunk is recomputed in backward
    (activation checkpointing) so the bound also holds for the entropy bonus."""
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, T, V), got {tuple(logits.shape)}")
    outs = []
    for start in range(0, logits.shape[1], max(chunk_size, 1)):
        chunk = logits[:, start:start + chunk_size]
        if chunk.requires_grad:  # recompute softmax in backward instead of keeping (B, T, V) float32 activations
            outs.append(checkpoint(_entropy_chunk, chunk, use_reentrant=False))
        else:
            outs.append(_entropy_chunk(chunk))
    if not outs:
        return logits.new_zeros(logits.shape[:2], dtype=torch.float32)
    return torch.cat(outs, dim=1)
