"""Loss aggregation: from per-token losses (B, T) to the micro-batch's share of the global loss.

Exact under data-parallel sharding and gradient accumulation: every mode divides by global counts the caller
passes in a `LossNormalizer`, so summing the returned values over all micro-batches and ranks gives the loss of
the whole global batch, and so does the gradient.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass
class LossNormalizer:
    """Global counts of the whole global batch (all ranks, all micro-batches), from `count_normalizer`."""

    global_num_tokens: float
    """Loss tokens (loss_mask True) in the global batch."""
    global_num_sequences: float
    """Sequences with at least one loss token in the global batch (fully masked samples do not count)."""
    max_response_tokens: int
    """Constant divisor of Dr.GRPO's token sum (the generation limit)."""


def count_normalizer(loss_mask: Tensor, max_response_tokens: int) -> LossNormalizer:
    """Counts for a LossNormalizer from a (N, T) loss mask. Call it on the whole global batch (or sum the counts
    of all shards, e.g. with an all-reduce) before the first micro-batch."""
    mask = loss_mask.bool()
    return LossNormalizer(
        global_num_tokens=float(mask.sum()),
        global_num_sequences=float(mask.any(dim=1).sum()),
        max_response_tokens=int(max_response_tokens),
    )


def aggregate_loss(per_token_loss: Tensor, loss_mask: Tensor, mode: str, normalizer: LossNormalizer,
                   sequence_lengths: Tensor | None = None) -> Tensor:
    """Micro-batch share of the global loss from per-token losses (B, T):
    token_mean (DAPO, Yu et al. 2025, eq. 8):              sum_{i,t} l_it / global_num_tokens
    seq_mean_token_mean (GRPO, Shao et al. 2024, eq. 3):   sum_i (sum_t l_it / |y_i|) / global_num_sequences
    seq_mean_token_sum_norm (Dr.GRPO, Liu et al. 2025):
                                  sum_i (sum_t l_it / max_response_tokens) / global_num_sequences
    where i runs over this micro-batch's sequences and |y_i| over its loss tokens. Masked positions are selected
    out (not multiplied), so NaN or huge values there never reach the loss or the gradient.

    sequence_lengths (B, T): |y_i| of the whole sequence each position belongs to, for rows that hold several
    sequences or a slice of one (sequence parallelism), where a row's mask cannot count |y_i|. seq_mean_token_mean
    then sums l_it / |y_i| per token, which adds up over slices to the same share; the other modes are sums over
    tokens divided by global constants, exact on any slice as they are."""
    mask = loss_mask.bool()
    masked = torch.where(mask, per_token_loss, torch.zeros((), dtype=per_token_loss.dtype,
                                                           device=per_token_loss.device))
    if mode == "token_mean":
        return masked.sum() / max(normalizer.global_num_tokens, 1.0)
    if mode == "seq_mean_token_mean":
        if sequence_lengths is not None:
            per_token = torch.where(mask, masked / sequence_lengths.to(masked.dtype).clamp(min=1), 0.0)
            return per_token.sum() / max(normalizer.global_num_sequences, 1.0)
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / max(normalizer.global_num_sequences, 1.0)
    if mode == "seq_mean_token_sum_norm":
        if normalizer.max_response_tokens < 1:
            raise ValueError(
                f"max_response_tokens={normalizer.max_response_tokens} must be >= 1 for "
                "algorithm.aggregation=seq_mean_token_sum_norm: it is the constant the token sum is divided by."
            )
        per_seq = masked.sum(dim=1) / normalizer.max_response_tokens
        return per_seq.sum() / max(normalizer.global_num_sequences, 1.0)
    raise ValueError(f"algorithm.aggregation={mode!r} must be one of {', '.join(AGGREGATIONS)}.")
