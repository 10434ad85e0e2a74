"""DeepSpeed side of sequence parallelism: the `mpu` that tells a DeepSpeed engine which ranks share a sample,
and the one call a learner rank makes to switch a model to Ulysses attention.

DeepSpeed 0.19 recognizes a Ulysses mpu by its `initialize_sequence_parallel` attribute (as its own
`runtime/sequence_parallel/parallel_state_sp` module has). It then partitions ZeRO state and reduces gradients
over all sp x dp ranks, dividing by dp only (engine `_reduce_non_expert_gradients`, ZeRO-1/2
`gradient_reduction_w_predivide` and `allreduce_bucket`: `world / sequence_parallel_size`): gradients are summed
over SP ranks and averaged over DP ranks. Its batch-size check counts world / sp data-parallel ranks.
"""

import torch
import torch.distributed as dist

from learner.sequence_parallel import SequenceParallelGroups, build_sequence_parallel_groups
from learner.ulysses_attention import install_ulysses_attention


class UlyssesMpu:
    """The functions of DeepSpeed's parallel_state_sp, backed by `SequenceParallelGroups` (so the groups are
    built once, by the learner, and the attention and the engine share them). Pass as deepspeed.initialize(mpu=)."""

    def __init__(self, groups: SequenceParallelGroups) -> None:
        self.groups = groups

    def initialize_sequence_parallel(self, sequence_parallel_size: int) -> None:
        # DeepSpeed only tests that this attribute exists; the groups are already built.
        raise RuntimeError("UlyssesMpu is built from existing groups; do not initialize it again")

    def get_sequence_parallel_group(self):
        return self.groups.sp_group

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.sp_size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.sp_rank

    def get_sequence_data_parallel_group(self):
        return self.groups.world_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.sp_size * self.groups.dp_size

    def get_sequence_data_parallel_rank(self) -> int:
        return dist.get_rank(self.groups.world_group)

    # DeepSpeed aliases model parallelism to SP for checkpoint naming (parallel_state_sp does the same).
    get_model_parallel_rank = get_sequence_parallel_rank
    get_model_parallel_world_size = get_sequence_parallel_world_size
    get_model_parallel_group = get_sequence_parallel_group


def enable_sequence_parallel(model: torch.nn.Module, sp_size: int,
                             groups: SequenceParallelGroups | None = None) -> tuple[SequenceParallelGroups, UlyssesMpu]:
    """Build the SP/DP groups (collective: all ranks, once) unless given, switch `model` (an HF causal LM loaded
    with attn_implementation 'sdpa' or 'flash_attention_2') to Ulysses attention, and return the groups and the
    mpu for deepspeed.initialize. Call it again with the same groups for a second model (the reference policy)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = groups or build_sequence_parallel_groups(sp_size)
    install_ulysses_attention(model, groups.sp_group, ALL_ATTENTION_FUNCTIONS)
    return groups, UlyssesMpu(groups)


def deepspeed_loss_scale(groups: SequenceParallelGroups) -> int:
    """Factor for a loss share (a sum over this rank's tokens / a global count) before engine.backward: DeepSpeed
    divides the summed gradient by the dp size under an SP mpu, so multiply by dp (not by the world size)."""
    return groups.dp_size
