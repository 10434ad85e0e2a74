"""How new weights reach the rollout engines (`weight_sync:` in the run config): the transport, chosen by `type`
(weights/backends.py is the one place that reads it), and the settings every transport shares: the sync
check (`verify_every`) and delta sync (`delta`). See docs/weight_sync.md.
"""

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class SyncCheck(BaseModel):
    """The weight-sync check, the same for every transport: after an engine loads a checked version it scores a
    fixed probe (protocols/weight_probe.py), the learner scores it at the same version, and the driver stops the
    run when the two disagree by more than the tolerance (weights/sync_check.py; docs/weight_sync.md)."""

    model_config = ConfigDict(extra="forbid")

    verify_every: int = Field(1, ge=0, le=1_000_000)
    """Check the versions that are multiples of this (0: no check). Each checked version costs the learner one
    forward of the probe and each engine that loads it one prefill of the probe, inside its decode steps: well
    under 1% of a step with the default probe. An engine that skips a checked version (it loads the newest) is
    not checked for it; `weights/verify_checks` counts the checks made."""

    verify_tolerance: float | None = Field(None, gt=0, le=100)
    """Largest |engine - learner| log-prob allowed on a probe token, in nats. None picks by model.dtype; with
    cluster.use_gpus and a 16-bit dtype the config fills in 2.0 at load (protocols/device_defaults.py says why).
    float32: 1e-3. tests/test_weight_sync.py measured 4e-7 to 1e-6 between vLLM's CPU engine and the DeepSpeed
    learner after a whole load, and 1.4 after a load that left out one MLP matrix one AdamW step (lr 1e-2) old;
    1e-3 leaves room for GPU kernels. bfloat16 and float16 on CPU: 0.5. The same setup run once in bf16 on CPU measured
    0.004 to 0.054 after whole loads and 1.42 for the load missing a tensor (bf16 keeps 8 bits of mantissa, and
    vLLM's kernels round differently from the learner's in every layer); not measured on a GPU
    (docs/weight_sync.md). Read a run's weights/verify_max_gap and set it a few times above that to catch smaller
    drifts; raise it when a run stops on a gap that is the hardware's rounding."""

    verify_sequences: int = Field(4, ge=1, le=64)
    """Sequences in the probe."""

    verify_prompt_tokens: int = Field(4, ge=1, le=4096)
    """Prompt tokens per probe sequence (context only; not compared)."""

    verify_response_tokens: int = Field(12, ge=1, le=4096)
    """Compared tokens per probe sequence. Prompt + response + 1 must fit the engine's context (refused at
    start); the defaults (17) fit the smallest contexts the tests use."""

    def check_tolerance(self, dtype: str) -> float:
        """`verify_tolerance`, or the default for the weights' dtype."""
        if self.verify_tolerance is not None:
            return self.verify_tolerance
        return 1e-3 if dtype == "float32" else 0.5


class ObjectStoreSync(SyncCheck):
    """Weights go learner rank 0 -> host memory -> one `ray.put` per version; every worker on a node maps it."""

    type: Literal["object_store"] = "object_store"
    """Backend name. The default: it needs nothing beyond Ray and works across nodes."""

    bucket_mb: int = Field(256, ge=1, le=65536)
    """Under ZeRO-3, parameters are gathered this many MiB at a time (never the whole model at once)."""

    delta: bool = False
    """Send only the elements that changed since the previous version (weights/delta.py), exact bit for bit.
    With bf16 weights at RL learning rates few elements change per step (docs/weight_sync.md: measured bytes);
    worth it when engines sit on other nodes than the learner. Costs one host copy of the model on the learner and
    one on each worker, and a full version (one more model copy in the object store) whenever the deltas since
    the last full one add up to its size; a worker behind or new loads that full version, then the deltas."""


class CollectiveSync(SyncCheck):
    """Learner rank 0 and every rollout engine join one torch.distributed group (gloo on CPU, NCCL on GPUs,
    separate from DeepSpeed's) and rank 0 broadcasts the weights in buckets."""

    type: Literal["collective"] = "collective"
    """Backend name."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto is nccl when the learner is on a GPU, else gloo."""

    bucket_mb: int = Field(256, ge=1, le=65536)
    """Bytes per broadcast (MiB). Bigger buckets reach a higher rate; each costs that much staging memory."""

    timeout_s: float = Field(120.0, gt=0, le=3600)
    """Limit on joining the group and on each broadcast; past it the run stops with an error, never hangs."""

    delta: bool = False
    """Broadcast only the elements that changed since the previous version (weights/delta.py), exact bit for
    bit; each engine applies it to its staging copy. The first broadcast of every group (the start, a rejoin after
    a replaced engine) is a full version. Costs one host copy of the model on the learner (docs/weight_sync.md)."""


WeightSyncConfig = Annotated[Union[ObjectStoreSync, CollectiveSync], Field(discriminator="type")]
