"""Defaults that depend on the device. The fields declare CPU-shaped defaults (float32, a small memory share, eager
decoding); with `cluster.use_gpus` each one the user left unset takes its GPU value
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


def gpu_defaults(use_gpus: bool, set_fields: set[str], dtype: str) -> dict[str, Any]:
    """The settings (dotted names) to fill under `use_gpus`, given the dotted names the user set and model.dtype
    as the user left it. Empty on CPU."""
    if not use_gpus:
        return {}
    return {name: value for name, value in GPU_DEFAULTS.items() if name not in set_fields}
