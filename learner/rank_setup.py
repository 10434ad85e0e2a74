"""What a learner rank settles before it computes: its device and process group (shared by the policy's ranks
and the critic's), which attention kernel and how much gradient
checkpointing the model gets, and how its peak memory is read. Used by learner/learner_actor.py and
learner/critic_rank.py (the ranks); which samples form each micro-batch is learner/batch_plan.py's.
"""

import os

import torch

from protocols.config import RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_probe(path: str) -> tuple[str, str | None]:
    import socket

    try:
        return socket.gethostname(), open(path).read()
    except OSError:
        return socket.gethostname(), None


NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"
"""Where a loaded NVIDIA kernel driver states its version (Linux)."""


def nvidia_driver() -> str:
    """The NVIDIA kernel driver's version line, or a sentence saying that none is loaded."""
    try:
        with open(NVIDIA_DRIVER_FILE) as f:
            return f.readline().strip()
    except OSError:
        return f"no NVIDIA kernel driver loaded ({NVIDIA_DRIVER_FILE} is missing)"


def cuda_missing_message(role: str, reason: str, torch_version: str, cuda_build: str | None, driver: str,
                         visible_devices: str | None) -> str:
    """Why a GPU role refuses to start without CUDA, and what to check (pure: the caller reads the machine)."""
    build = f"built for CUDA {cuda_build}" if cuda_build else "a CPU-only build (torch.version.cuda is None)"
    visible = "unset" if visible_devices is None else repr(visible_devices)
    return (f"cluster.use_gpus=true, but {role} cannot use CUDA: {reason}. "
            f"torch {torch_version} is {build}; driver: {driver}; CUDA_VISIBLE_DEVICES={visible}. "
            "Fix: on this node, `nvidia-smi` must list the GPUs (the pinned CUDA 13 wheels need driver 580 or "
            "newer), torch.version.cuda must name a CUDA version (install the GPU extra, not the CPU one), and "
            "Ray must have given this actor its GPU; or set cluster.use_gpus=false to run every role on CPU")


def require_cuda(use_gpus: bool, role: str, cuda_available: bool | None = None, holds_gpu: bool = True) -> bool:
    """Whether `role` computes on CUDA: with cluster.use_gpus it must (RuntimeError naming torch's CUDA build,
    the driver and the fix, never a silent fall back to CPU); without, it never does. `cuda_available` defaults
    to torch.cuda.is_available() for an actor that holds its GPU; an actor that holds none itself (a
    tensor-parallel engine's, whose vLLM workers hold them) needs a CUDA build of torch and a loaded driver."""
    if not use_gpus:
        return False
    if cuda_available is None:
        if holds_gpu:
            cuda_available, reason = torch.cuda.is_available(), "torch.cuda.is_available() is False"
        else:
            cuda_available = torch.version.cuda is not None and os.path.exists(NVIDIA_DRIVER_FILE)
            reason = "its engine's workers need a CUDA build of torch and a loaded NVIDIA driver"
    else:
        reason = "torch.cuda.is_available() is False"
    if not cuda_available:
        raise RuntimeError(cuda_missing_message(role, reason, torch.__version__, torch.version.cuda,
                                                nvidia_driver(), os.environ.get("CUDA_VISIBLE_DEVICES")))
    return True


class DeepSpeedRank:
    """The preamble the policy's ranks (learner/learner_actor.py) and the critic's (learner/critic_rank.py)
    share: the rank's place in its group, its device, and joining the group's process group."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.model_path = model_path
        self.use_cuda = require_cuda(cfg.cluster.use_gpus, f"{type(self).__name__} {rank}")
        if not self.use_cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"
        self.engine = None

    def _device(self) -> torch.device:
        return self.engine.device if self.use_cuda else torch.device("cpu")

    def read_probe(self, path: str) -> tuple[str, str | None]:
        """(this rank's host name, the text of `path`, or None if this rank cannot read it): the driver checks
        that every rank sees the run folder it writes checkpoints and the final model into."""
        return read_probe(path)

    def _join_process_group(self, deepspeed, master_addr: str, master_port: int, backend: str) -> None:
        """Join the group's process group, then seed torch the same on every rank (train.seed).
        `deepspeed` is the module, passed in because only the rank files import DeepSpeed."""
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        init_distributed(deepspeed, backend, self.rank, self.world_size, f"tcp://{master_addr}:{master_port}")
        torch.manual_seed(self.cfg.train.seed)


SHM_INFERENCE_OP = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory all-reduce for CPUs: its inference kernel (`inference_all_reduce`), which training
never calls."""


def init_distributed(deepspeed, backend: str, rank: int, world_size: int, init_method: str) -> None:
    """deepspeed.init_distributed without the shared-memory inference op. DeepSpeed builds that op whenever a
    process group starts on a CPU, a C++ compile (about 50 s on 2 cores) on a fresh machine and again whenever
    the environment's path changes (the build is keyed on its include paths); nothing here uses it."""
    deepspeed.ops.__compatible_ops__[SHM_INFERENCE_OP] = False
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False, rank=rank,
                               world_size=world_size, init_method=init_method)


def deepspeed_config(gradient_accumulation_steps: int, max_grad_norm: float, zero_stage: int, dtype: str) -> dict:
    """The DeepSpeed config of a rank's engine. One "DeepSpeed micro-batch" per forward/backward whatever it
    holds: the count of micro-batches can vary from step to step (token budgets), so train_step sets the
    accumulation boundary itself and scales the loss itself (global normalizers); DeepSpeed never divides by its
    gradient_accumulation_steps."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bfloat16"},
        "fp16": {"enabled": dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def micro_batches(num_samples: int, micro_batch_size: int) -> list[slice]:
    return [slice(i, min(i + micro_batch_size, num_samples)) for i in range(0, num_samples, micro_batch_size)]


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


def attention_kernels() -> set:
    """The fused attention ops torch's sdpa dispatches to (GPU flash / memory-efficient / cuDNN, and CPU flash):
    the only ops in a decoder layer whose cost grows with length squared."""
    names = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward"]
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def keep_attention_context():
    """A selective-checkpoint context (torch.utils.checkpoint.create_selective_checkpoint_contexts) that keeps
    the attention kernels' outputs and recomputes everything else: backward re-runs the layer's projections,
    norms and MLP, but never the O(T^2) attention forward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kernels = attention_kernels()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kernels else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_gradient_checkpointing(model: torch.nn.Module, uncheckpointed_layers: int,
                                  keep_attention: bool = False) -> int:
    """Checkpoint every decoder layer but the last `uncheckpointed_layers` (learner.uncheckpointed_layers);
    returns how many are checkpointed. With `keep_attention` (learner.checkpoint_keeps_attention) a checkpointed
    layer still keeps its attention output. Checkpointing changes memory and time, never the numbers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"use_reentrant": False}  # selective checkpointing exists only for the non-reentrant variant
    if keep_attention:
        kwargs["context_fn"] = keep_attention_context
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers[len(layers) - min(uncheckpointed_layers, len(layers)):]:
        layer.gradient_checkpointing = False
    return sum(layer.gradient_checkpointing for layer in layers)
