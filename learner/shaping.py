"""Reward shaping applied before the advantages: DAPO's soft overlong punishment and the truncated-sample mask.

Both act per sample on (N,) tensors, on the driver, once per global batch.
"""

import torch
from torch import Tensor


def overlong_penalty(response_lengths: Tensor, max_response_tokens: int, buffer_tokens: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), with L_max = max_response_tokens
    and L_cache = buffer_tokens, scaled by penalty_factor:
        0                                  if |y| <= L_max - L_cache
        ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max   (falls linearly to -1)
        -1                                 if |y| > L_max
    Returns the (N,) value to add to the rewards (<= 0)."""
    if not 0 < buffer_tokens < max_response_tokens:
        raise ValueError(
            f"algorithm.overlong buffer of {buffer_tokens} tokens must be in (0, max_response_tokens="
            f"{max_response_tokens}): the penalty ramps over the last buffer tokens. Lower "
            "algorithm.overlong.buffer_tokens or buffer_fraction."
        )
    lengths = response_lengths.to(torch.float32)
    start = float(max_response_tokens - buffer_tokens)
    ramp = (start - lengths) / buffer_tokens
    pen = torch.where(lengths <= start, torch.zeros_like(lengths), ramp)
    pen = torch.where(lengths > max_response_tokens, torch.full_like(lengths, -1.0), pen)
    return penalty_factor * pen


def overlong_buffer_tokens(max_response_tokens: int, buffer_tokens: int, buffer_fraction: float) -> int:
    """L_cache in tokens: buffer_tokens if > 0, else round(buffer_fraction * max_response_tokens), at least 1."""
    if buffer_tokens > 0:
        return buffer_tokens
    return max(1, int(round(buffer_fraction * max_response_tokens)))


def truncated_sample_mask(truncated: Tensor, mask_truncated: bool) -> Tensor:
    """(N,) bool, False for samples to drop from the loss: truncated ones when mask_truncated (DAPO's overlong
    filtering, Yu et al. 2025 section 3.4), otherwise all True."""
    truncated = truncated.bool()
    return ~truncated if mask_truncated else torch.ones_like(truncated)
