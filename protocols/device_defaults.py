"""Defaults that depend on the device. The fields declare CPU-shaped defaults (float32, a small memory share, eager
decoding, a CPU-measured sync tolerance); with `cluster.use_gpus` each one the user left unset takes its GPU value
instead. RunConfig applies them when a config loads, so the run folder's config.yaml says what ran. A value the
user set is kept on either device; a CPU run is never changed.
"""

from typing import Any

GPU_DEFAULTS: dict[str, Any] = {
    "model.dtype": "bfloat16",
    # The engine has its GPUs to itself (its own placement bundle); vLLM refuses to start when its share cannot
    # hold the weights and one max-length sequence's KV cache, and 0.85 leaves room for CUDA graphs and the
    # weight-sync staging.
    "rollout.gpu_memory_utilization": 0.85,
    # CUDA graphs: the in-place weight reload copies into the captured storage, so the graphs stay valid.
    "rollout.enforce_eager": False,
}
"""Setting -> its value under cluster.use_gpus when the user did not set it."""

GPU_16BIT_SYNC_TOLERANCE = 2.0
"""weight_sync.verify_tolerance on GPUs in bfloat16 / float16 when unset, in nats (docs/weight_sync.md). The CPU
default, 0.5, was set from a 0.3M-parameter model on vLLM's CPU kernels; on a GPU vLLM's fused kernels and the
learner's round differently in every layer of a model 5,000 to 25,000 times larger, and the probe's tokens are
drawn uniformly from the vocabulary, so they sit in the low-probability tail where the gap is largest (up to 0.32
nats was reported on ordinary text for a 1.7B model in bf16, vLLM against transformers on a GPU:
vllm-project/vllm#18352). Not measured here (no GPU vLLM on these machines). 2.0 still stops a load that scrambles
or misses whole tensors (several nats); `weights/verify_max_gap` of a healthy run is the number to set it from."""


def gpu_defaults(use_gpus: bool, set_fields: set[str], dtype: str) -> dict[str, Any]:
    """The settings (dotted names) to fill under `use_gpus`, given the dotted names the user set (a tolerance set
    to null counts as unset: null means "pick by dtype") and model.dtype as the user left it. Empty on CPU."""
    if not use_gpus:
        return {}
    out = {name: value for name, value in GPU_DEFAULTS.items() if name not in set_fields}
    dtype = out.get("model.dtype", dtype)
    if dtype != "float32" and "weight_sync.verify_tolerance" not in set_fields:
        out["weight_sync.verify_tolerance"] = GPU_16BIT_SYNC_TOLERANCE
    return out


def check_gpu_weight_sync(use_gpus: bool, weight_sync_type: str, tensor_parallel_size: int) -> None:
    """Refuse, at config load, a weight transport that would not work on GPUs. The collective transport receives
    each version in the engine actor, not in each tensor-parallel worker: at tensor_parallel_size > 1 that actor
    holds no GPU, and at 1 it stages a full copy of the weights beside the engine's memory reservation (15 GB at
    7B in bf16: out of memory at utilization 0.85). vLLM's own weight-transfer engine, with every worker a member
    of the group, is what would fix it; relayrl does not use it yet (docs/weight_sync.md)."""
    if use_gpus and weight_sync_type == "collective":
        raise ValueError(
            f"weight_sync.type=collective with cluster.use_gpus=true (rollout.tensor_parallel_size="
            f"{tensor_parallel_size}) is not supported: the collective transport receives each version in the "
            "engine actor, not in each tensor-parallel worker, and stages a full copy of the weights beside the "
            "engine's memory reservation. Set weight_sync.type=object_store: each tensor-parallel worker then "
            "loads its version from the object store (zero-copy on its node) through the vLLM worker extension")
