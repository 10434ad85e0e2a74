"""What a learner rank settles before it computes: which samples form each micro-batch, which attention kernel
and how much gradient checkpointing the model gets, and how its peak memory is read. Used by
learner/learner_actor.py (the rank) and cluster/learner_group.py (the driver's micro-batch count).
"""

import torch

from learner.micro_batches import sample_count_micro_batches, token_budget_micro_batches
from protocols.config import RunConfig


def micro_batches(num_samples: int, micro_batch_size: int) -> list[slice]:
    return [slice(i, min(i + micro_batch_size, num_samples)) for i in range(0, num_samples, micro_batch_size)]


def sample_tokens(shard: dict) -> list[int]:
    """Prompt + response tokens of each sample: what a micro-batch's budget counts."""
    return [len(p) + len(r) for p, r in zip(shard["prompt_ids"], shard["response_ids"])]


def plan_micro_batches(shard: dict, cfg: RunConfig, count: int | None) -> list[list[int]]:
    """Sample indices of each micro-batch of this rank, exactly `count` of them when given (the driver's count
    for all ranks; empty lists pad a rank that has fewer samples than micro-batches)."""
    budget = cfg.learner.max_tokens_per_micro_batch
    if budget > 0:
        # Sequence parallel rows are always packed (learner.sequence_parallel.pack_row).
        plan = token_budget_micro_batches(sample_tokens(shard), budget, count=count or 0,
                                          padded=not (cfg.learner.packing or cfg.learner.sequence_parallel_size > 1))
    else:
        plan = sample_count_micro_batches(len(shard["prompt_ids"]), cfg.learner.micro_batch_size)
    if count is not None and len(plan) > count:
        raise ValueError(
            f"this rank needs {len(plan)} micro-batches for its {len(shard['prompt_ids'])} samples but was told to "
            f"run {count}: every rank must run the same number (the driver's count must be the largest any rank "
            f"needs; see learner.micro_batches.micro_batch_count)")
    return plan + [[] for _ in range((count or 0) - len(plan))]


def attention_implementation(use_cuda: bool, packing: bool, dtype: torch.dtype) -> str:
    """flash_attention_2 for packed rows on a GPU when the flash-attn package is installed: it reads the sample
    boundaries from position_ids (varlen) with no mask at all. Otherwise sdpa, which transformers gives a
    block-diagonal causal mask for packed rows: exact, but the mask costs rows x length^2 bytes."""
    import importlib.util

    if use_cuda and packing and dtype != torch.float32 and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory since the last reset_peak_memory: the CUDA allocator's on a GPU, the process's peak resident
    set (VmHWM) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets the peak resident set size to the current one
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def enable_gradient_checkpointing(model: torch.nn.Module, uncheckpointed_layers: int) -> int:
    """Checkpoint every decoder layer but the last `uncheckpointed_layers` (learner.uncheckpointed_layers);
    returns how many are checkpointed. Checkpointing changes memory and time, never the numbers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers[len(layers) - min(uncheckpointed_layers, len(layers)):]:
        layer.gradient_checkpointing = False
    return sum(layer.gradient_checkpointing for layer in layers)
