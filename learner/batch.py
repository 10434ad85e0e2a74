"""Turning trajectories into padded tensors, and scoring responses with a causal LM.

A row is [left padding, prompt, response, right padding]: every response starts at the same column P, so the
model computes logits for the last T + 1 positions only (`logits_to_keep`), never (B, L, V). Per-token tensors
are `(B, T)` over response positions. Pure torch: no Ray, vLLM or DeepSpeed.
"""

from dataclasses import dataclass

import torch


@dataclass
class SampleBatch:
    """One micro-batch. `input_ids`/`attention_mask` are (B, L); per-token tensors are (B, T) over the response."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    """(B, L) positions counted from each prompt's first token, as vLLM counts them."""
    loss_mask: torch.Tensor
    """(B, T) bool: True on real response tokens."""
    response_ids: torch.Tensor
    """(B, T) response token ids (pad where masked)."""


def collate(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> SampleBatch:
    batch = len(prompt_ids)
    width_p = max(len(p) for p in prompt_ids)
    width_t = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((batch, width_p + width_t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width_p + width_t), dtype=torch.long)
    loss_mask = torch.zeros((batch, width_t), dtype=torch.bool)
    resp = torch.full((batch, width_t), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        start = width_p - len(p)
        input_ids[i, start: width_p + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, start: width_p + len(r)] = 1
        loss_mask[i, : len(r)] = True
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return SampleBatch(input_ids, attention_mask, position_ids, loss_mask, resp)


def pad_per_token(values: list[list[float]], width: int) -> torch.Tensor:
    """Ragged per-token floats -> (B, width) float32, zero-padded."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, row in enumerate(values):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def response_logits(model: torch.nn.Module, batch: SampleBatch, temperature: float) -> torch.Tensor:
    """(B, T, V) logits that predict each response token, divided by the sampling temperature.

    Response token j sits at column P + j and is predicted by the output at P + j - 1, so the last T + 1 output
    positions are computed and the final one dropped.
    """
    width_t = batch.loss_mask.size(1)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                logits_to_keep=width_t + 1)
    logits = out.logits[:, :width_t].float()
    # Each (B, T, V) fp32 copy costs ~0.6 MB per token at a 151k vocabulary: skip the divide when it is a no-op.
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for (B, T, V) logits and (B, T) ids, without materializing all log-probs."""
    picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
