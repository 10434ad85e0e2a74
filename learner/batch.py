"""Turning trajectories into padded tensors, and scoring responses with a causal LM.

A sample is prompt + response, right-padded into one row; `response_index` says where each response token sits
so that per-token tensors are `(B, T)` over response positions only. Pure torch: no Ray, vLLM or DeepSpeed.
"""

from dataclasses import dataclass

import torch


@dataclass
class SampleBatch:
    """One micro-batch. `input_ids`/`attention_mask` are (B, L); per-token tensors are (B, T) over the response."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_index: torch.Tensor
    """(B, T) position in `input_ids` of each response token (0 where padded)."""
    loss_mask: torch.Tensor
    """(B, T) bool: True on real response tokens."""
    response_ids: torch.Tensor
    """(B, T) response token ids (pad where masked)."""


def collate(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> SampleBatch:
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    batch, max_len = len(prompt_ids), max(lengths)
    max_resp = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((batch, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, max_len), dtype=torch.long)
    response_index = torch.zeros((batch, max_resp), dtype=torch.long)
    loss_mask = torch.zeros((batch, max_resp), dtype=torch.bool)
    resp = torch.full((batch, max_resp), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, : len(p) + len(r)] = 1
        response_index[i, : len(r)] = torch.arange(len(p), len(p) + len(r))
        loss_mask[i, : len(r)] = True
        resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return SampleBatch(input_ids, attention_mask, response_index, loss_mask, resp)


def pad_per_token(values: list[list[float]], width: int) -> torch.Tensor:
    """Ragged per-token floats -> (B, width) float32, zero-padded."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, row in enumerate(values):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def response_logits(model: torch.nn.Module, batch: SampleBatch, temperature: float) -> torch.Tensor:
    """(B, T, V) logits that predict each response token, divided by the sampling temperature.

    The token at position p is predicted by the output at p - 1; only those rows are kept, so the full
    (B, L, V) tensor is never turned into log-probs.
    """
    hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    predict_at = (batch.response_index - 1).clamp(min=0)
    logits = torch.gather(hidden, 1, predict_at.unsqueeze(-1).expand(-1, -1, hidden.size(-1)))
    return logits.float() / temperature


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for (B, T, V) logits and (B, T) ids, without materializing all log-probs."""
    picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
