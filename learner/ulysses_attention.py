"""Ulysses attention for sequence parallelism: each rank of an SP group holds a 1/sp slice of the row along T;
attention swaps it for a 1/sp slice of the heads with a differentiable all-to-all (each rank then sees the whole
sequence for its heads), runs the model's own attention kernel, and swaps back. The rows, slices and scoring
around it are in learner/sequence_parallel.py. Pure torch.
"""

from collections.abc import Callable, MutableMapping

import torch
import torch.distributed as dist
from torch import Tensor

from learner.sequence_parallel import gather_sequence

# --- the all-to-all --------------------------------------------------------------------------------------------


def _all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> Tensor:
    world = dist.get_world_size(group)
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    # gloo (CPU) and nccl both implement all_to_all_single.
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    """Chunk `scatter_dim` over the group, send chunk j to rank j, join what arrives along `gather_dim`. The op
    only moves numbers, so its backward is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, group, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: Tensor, group: dist.ProcessGroup | None, scatter_dim: int, gather_dim: int) -> Tensor:
    """Differentiable all-to-all: e.g. (B, H, S, D) scattered on heads (1), gathered on T (2) -> (B, H/sp, L, D)."""
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim)


# --- attention ----------------------------------------------------------------------------------------------------


def packed_causal_mask(position_ids: Tensor) -> Tensor | None:
    """(B, 1, L, L) bool mask, True where query t may see key s: s <= t and no position restart between them.
    None when no row restarts (plain causal attention, which sdpa does without a mask)."""
    starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts.any()):
        return None
    segment = torch.cat([torch.zeros_like(position_ids[:, :1]), starts.long()], dim=1).cumsum(dim=1)
    length = position_ids.size(1)
    causal = torch.ones((length, length), dtype=torch.bool, device=position_ids.device).tril()
    same = segment[:, :, None] == segment[:, None, :]
    return (same & causal)[:, None]


# Set by the FlashAttention kernels from the local slice; wrong for the gathered sequence, so they are dropped
# and the kernel derives them again from the gathered position_ids.
_LOCAL_LENGTH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class UlyssesAttention:
    """Wraps a Hugging Face attention function (`sdpa`, `flash_attention_*`) for one SP group. Inputs are this
    rank's slice: q (B, H, S, D), k and v (B, KV, S, D); the output is (B, S, H, D) as HF attention returns it."""

    def __init__(self, group: dist.ProcessGroup | None, implementation: str, num_heads: int, num_kv_heads: int):
        self.group = group
        self.implementation = implementation
        self.sp_size = dist.get_world_size(group)
        check_heads_split(num_heads, num_kv_heads, self.sp_size)
        # With fewer KV heads than SP ranks each rank takes one KV head, copied sp / KV times (as ALST does).
        self.kv_repeat = max(1, self.sp_size // num_kv_heads)

    def __call__(self, core: Callable, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask, *args, **kwargs):
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ValueError("sequence parallel attention needs position_ids in the model call: without them each "
                             "rank numbers its slice from 0 and the gathered row looks like packed sequences")
        positions = gather_sequence(positions.expand(query.size(0), -1), self.group)
        if self.kv_repeat > 1:
            key = key.repeat_interleave(self.kv_repeat, dim=1)
            value = value.repeat_interleave(self.kv_repeat, dim=1)
        query = seq_all_to_all(query, self.group, scatter_dim=1, gather_dim=2)
        key = seq_all_to_all(key, self.group, scatter_dim=1, gather_dim=2)
        value = seq_all_to_all(value, self.group, scatter_dim=1, gather_dim=2)
        for name in _LOCAL_LENGTH_KWARGS:
            kwargs.pop(name, None)
        kwargs["position_ids"] = positions
        # HF built `attention_mask` for the local slice length. FlashAttention reads packing from position_ids;
        # sdpa gets a block-diagonal mask only when the row holds several sequences (is_causal otherwise).
        mask = None if "flash" in self.implementation else packed_causal_mask(positions)
        groups_before = module.num_key_value_groups
        module.num_key_value_groups = query.size(1) // key.size(1)
        try:
            out, weights = core(module, query, key, value, mask, *args, **kwargs)
        finally:
            module.num_key_value_groups = groups_before
        # (B, L, H/sp, D) -> (B, S, H, D)
        return seq_all_to_all(out, self.group, scatter_dim=1, gather_dim=2), weights


def check_heads_split(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    if num_heads % sp_size:
        raise ValueError(f"learner.sequence_parallel_size={sp_size} does not divide the model's {num_heads} "
                         f"attention heads; each SP rank attends with an equal share of heads. Use a size that "
                         f"divides {num_heads}")
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        raise ValueError(f"learner.sequence_parallel_size={sp_size} and the model's {num_kv_heads} KV heads do not "
                         f"divide one another; use a size that divides {num_kv_heads} or a multiple of it")


SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def install_ulysses_attention(model: torch.nn.Module, group: dist.ProcessGroup | None,
                              attention_functions: MutableMapping[str, Callable]) -> int:
    """Make `model`'s attention layers run Ulysses attention over `group`; returns how many layers.

    `attention_functions` is transformers' ALL_ATTENTION_FUNCTIONS (passed in to keep this module torch-only).
    Like DeepSpeed's UlyssesSPAttentionHF.register_with_transformers, the model's own implementation key (e.g.
    `sdpa`) is replaced by a wrapper, so every HF code path that checks that key still runs; unlike it, the
    wrapper only reroutes layers marked here, so other models in the process (a reference model without SP,
    a test's baseline) keep plain attention."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(f"sequence parallelism needs the model loaded with attn_implementation in "
                         f"{SUPPORTED_ATTENTION}, got {implementation!r}: eager attention needs a full (L, L) mask "
                         f"per layer. Load it with attn_implementation='sdpa' (CPU) or 'flash_attention_2' (GPU)")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    ulysses = UlyssesAttention(group, implementation, text_config.num_attention_heads,
                               getattr(text_config, "num_key_value_heads", text_config.num_attention_heads))
    layers = 0
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") and hasattr(module, "head_dim"):
            module.ulysses_attention = ulysses
            layers += 1
    if not layers:
        raise ValueError(f"found no attention layer in {type(model).__name__} (looked for modules with "
                         f"num_key_value_groups and head_dim, as Llama/Qwen/Mistral attention has)")
    core = attention_functions[implementation]
    if not getattr(core, "dispatches_ulysses", False):
        attention_functions[implementation] = _dispatcher(core)
    return layers


def _dispatcher(core: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        ulysses = getattr(module, "ulysses_attention", None)
        if ulysses is None:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        return ulysses(core, module, query, key, value, attention_mask, *args, **kwargs)

    attention.dispatches_ulysses = True
    return attention
