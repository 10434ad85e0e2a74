"""Per-token log-probs and entropy straight from hidden states, without the (N, V) logits tensor.

The LM head's logits for N scored positions are computed `chunk_tokens` positions at a time, reduced in fp32
(log-sum-exp, the target's logit, the entropy) and dropped; backward recomputes each chunk's logits. Memory is
O(chunk_tokens * V) instead of O(N * V): at a 151,936-token vocabulary one fp32 copy of the logits costs
0.6 MB per token, 18.5 GiB at 32k tokens. Pure torch; learner/batch.py routes the model's head through it.
"""

import torch
from torch import Tensor


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = hidden @ weight.t()
    if bias is not None:
        z += bias
    z = z.float()  # a fresh fp32 buffer (or the matmul's own output in fp32): safe to modify in place
    return z if temperature == 1.0 else z.div_(temperature)


def _dot_rows(a: Tensor, b: Tensor) -> Tensor:
    """sum_v a[n, v] * b[n, v] without an (N, V) temporary."""
    return torch.bmm(a[:, None, :], b[:, :, None]).view(-1)


class _ChunkedLinearScores(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), bias (V,) or None, targets (N, m)) -> (logprobs (N, m), entropy (N,)), fp32:
    m ids scored at each position (the sampled token, and the teacher's top-k ones for distillation)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_tokens: int):
        n = hidden.shape[0]
        logprobs = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk_tokens):
            z = _chunk_logits(hidden[s:s + chunk_tokens], weight, bias, temperature)
            lse = torch.logsumexp(z, dim=-1)
            logprobs[s:s + chunk_tokens] = z.gather(-1, targets[s:s + chunk_tokens]) - lse[:, None]
            # H = lse - E_p[z]
            entropy[s:s + chunk_tokens] = lse - _dot_rows(torch.softmax(z, dim=-1), z)
            lse_all[s:s + chunk_tokens] = lse
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all)
        ctx.temperature = temperature
        ctx.chunk_tokens = chunk_tokens
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse_all = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        temperature, chunk = ctx.temperature, ctx.chunk_tokens
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulate the head's gradient in fp32 over chunks: bf16 sums over 10^5 positions would lose bits.
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            z = _chunk_logits(h, weight, bias, temperature)
            lse = lse_all[s:s + chunk, None]
            # d logprob_j / dz = onehot(target_j) - p, summed over the m targets with their grads g_j:
            # scatter(g) - p * sum_j g_j;  d H / dz = -p * (z - E_p[z]). In place: two (chunk, V) fp32 buffers.
            g = grad_logprobs[s:s + chunk] if grad_logprobs is not None else None
            g_sum = g.sum(dim=-1, keepdim=True) if g is not None else None
            if grad_entropy is not None:
                p = torch.exp(z - lse)
                z -= _dot_rows(p, z)[:, None]
                grad_z = z.mul_(p).mul_(-grad_entropy[s:s + chunk, None])
                if g is not None:
                    grad_z.addcmul_(p, g_sum, value=-1.0)
                del p
            else:
                grad_z = z.sub_(lse).exp_().mul_(-g_sum)
            if g is not None:
                grad_z.scatter_add_(-1, targets[s:s + chunk], g)
            del z
            if temperature != 1.0:
                grad_z /= temperature
            grad_z_lp = grad_z.to(weight.dtype)
            if need_h:
                grad_h[s:s + chunk] = (grad_z_lp @ weight).to(hidden.dtype)
            if need_w:
                grad_w += grad_z_lp.t() @ h.to(weight.dtype)  # upcast while adding: no fp32 (V, H) temporary
            if need_b:
                grad_b += grad_z.sum(dim=0)
            del grad_z, grad_z_lp
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None


def chunked_logprobs_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                             temperature: float = 1.0, chunk_tokens: int = 2048) -> tuple[Tensor, Tensor]:
    """log softmax(h W^T + b)[target] / temperature-scaled, and the entropy of that softmax, per position.

    hidden (N, H) decoder outputs at the scored positions, weight (V, H) the LM head (the embedding matrix when
    tied), targets (N,) token ids, or (N, m) for m ids a position. Returns (logprobs shaped as targets,
    entropy (N,)) in fp32, both differentiable w.r.t. hidden, weight and bias: backward recomputes each chunk's
    logits, so no (N, V) tensor is ever kept."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be (N, H) and weight (V, H); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"learner.logits_chunk_tokens={chunk_tokens} must be >= 1 here (0 selects the full-logits "
                         "path before this function is reached)")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + weight.sum() * 0  # keeps the graph connected
        return empty.reshape(targets.shape), empty.clone()
    lp, ent = _ChunkedLinearScores.apply(hidden, weight, bias, targets.long().reshape(targets.shape[0], -1),
                                         float(temperature), int(chunk_tokens))
    return lp.reshape(targets.shape), ent


@torch.no_grad()
def chunked_topk_logprobs(hidden: Tensor, weight: Tensor, k: int, *, bias: Tensor | None = None,
                          temperature: float = 1.0, chunk_tokens: int = 2048) -> tuple[Tensor, Tensor]:
    """(ids (N, k) long, logprobs (N, k) fp32): the k most likely tokens of softmax(h W^T + b) / temperature at each
    position, most likely first, `chunk_tokens` positions at a time (no (N, V) tensor). No grad: a frozen teacher's
    top-k for on-policy distillation."""
    n = hidden.shape[0]
    ids = torch.empty((n, k), dtype=torch.long, device=hidden.device)
    logprobs = torch.empty((n, k), dtype=torch.float32, device=hidden.device)
    for s in range(0, n, max(1, chunk_tokens)):
        z = _chunk_logits(hidden[s:s + chunk_tokens], weight, bias, temperature)
        top = z.topk(k, dim=-1)
        ids[s:s + chunk_tokens] = top.indices
        logprobs[s:s + chunk_tokens] = top.values - torch.logsumexp(z, dim=-1, keepdim=True)
        del z
    return ids, logprobs

