"""Packing model weights for transport from the learner to the rollout workers.

Weights travel as numpy arrays because Ray stores those zero-copy in shared memory: one `ray.put` per version,
and every rollout worker on the node maps the same bytes. bf16 has no numpy dtype, so it travels as int16 bits.
Tied embeddings: the HF state dict lists both `embed_tokens` and `lm_head`; both are sent, because vLLM's CPU
backend keeps a separately repacked `lm_head` that is stale unless it is loaded too.
"""

import warnings

import numpy as np
import torch

_BITCAST = {torch.bfloat16: torch.int16}


def pack_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (torch dtype name, numpy array). Tensors are copied to CPU and made contiguous."""
    packed = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        dtype = tensor.dtype
        if dtype in _BITCAST:
            tensor = tensor.view(_BITCAST[dtype])
        packed[name] = (str(dtype).removeprefix("torch."), tensor.numpy())
    return packed


def unpack_state_dict(packed: dict[str, tuple[str, np.ndarray]]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `pack_state_dict`, as (name, tensor) pairs in checkpoint format. Shares memory with the arrays."""
    out = []
    for name, (dtype_name, array) in packed.items():
        with warnings.catch_warnings():
            # Arrays from the Ray object store are read-only views; the engine copies them into its own
            # parameters, so no copy is made here.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        dtype = getattr(torch, dtype_name)
        if dtype in _BITCAST:
            tensor = tensor.view(dtype)
        out.append((name, tensor))
    return out


def packed_num_bytes(packed: dict[str, tuple[str, np.ndarray]]) -> int:
    return sum(array.nbytes for _, array in packed.values())
