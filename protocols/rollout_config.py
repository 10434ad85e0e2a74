"""The `rollout:` section of the run config: the vLLM rollout workers, their engines, and the pool's size over the
run (`relayrl scale`, the autoscaler)."""

from pydantic import BaseModel, ConfigDict, Field

from protocols.autoscale import AutoscaleConfig


class RolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(1, ge=1)
    """Rollout workers, each owning one vLLM engine. Raise it to generate faster; the learner is unchanged."""

    samples_per_prompt: int = Field(8, ge=1)
    """Group size G. Group baselines need at least two samples; 8 to 16 is common for GRPO. 1 only under pure
    distillation (algorithm.distillation.weight=1): the teacher's per-token signal needs no group, so each sample
    may come from another prompt."""

    max_response_tokens: int = Field(16, ge=1)
    """Responses stop here and are marked truncated (finish_reason `length`)."""

    temperature: float = Field(1.0, gt=0)
    """Sampling temperature. The importance ratio assumes the learner scores with the same temperature."""

    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling. Values below 1 make behavior log-probs differ from the learner's full-softmax ones."""

    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per vLLM engine (tensor parallel). Ignored on CPU."""

    gpu_memory_utilization: float = Field(0.1, gt=0, le=0.99)
    """Share of device memory vLLM reserves for the weights, activations, CUDA graphs and KV cache. On CPU it
    reserves host RAM: keep it small (0.1, the default there; the KV cache is cpu_kvcache_gib). Unset with
    cluster.use_gpus: 0.85 (protocols/device_defaults.py). On a GPU vLLM refuses to start when the share cannot
    hold the weights and one max-length sequence's KV cache (raise it), or when another process holds more than
    the rest of the GPU (lower it)."""

    cpu_kvcache_gib: int = Field(1, ge=1)
    """KV cache size on CPU in GiB (VLLM_CPU_KVCACHE_SPACE)."""

    max_num_seqs: int = Field(256, ge=1)
    """Sequences one engine decodes at once."""

    prefix_caching: bool = True
    """vLLM's prefix cache, salted per weight version (actors/prefix_cache.py): a request skips the prefill of
    the whole KV blocks an earlier request under the same weights computed (a group's samples share their prompt, a
    session's calls its history); KV from older weights is never reused. `rollout/prefix_cache_hit_rate` says
    what it saves. Off: every request prefills its whole prompt."""

    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    """Grow and shrink the pool from what the run measures (cluster/autoscaler.py); off by default."""

    drain_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """Seconds a rollout worker leaving a running job (`relayrl scale`, cluster/scale_requests.py) has to finish
    the groups it holds; those still out then are aborted and their prompts go back to the queue (dropped
    `rollout_worker_drained`, never trained twice). Raise it for long chain-of-thought responses."""

    prompts_in_flight: int = Field(64, ge=1)
    """Groups a worker keeps in its engine at once (each holds samples_per_prompt sequences). A group holds its
    slots until its longest sample ends, so about 4 * max_num_seqs / samples_per_prompt keeps the engine full;
    admission (train.max_staleness) caps it further."""

    length_aware_dispatch: bool = False
    """Hold the granted groups at the worker and hand the engine the one expected longest, whole, each time the
    engine's queue is empty (it then never holds more than one group beyond max_num_seqs). The expectation is a
    prompt's `length_hint` in its metadata if the data gives one, else the mean response length of its earlier
    groups in this run (actors/length_history.py); it never reads the answer. Only acts when prompts_in_flight *
    samples_per_prompt exceeds max_num_seqs. Off by default: in the simulator (docs/length_aware_dispatch.md) it
    was no faster at the long-tail staleness rule's k (0.98 to 1.01 of the default's throughput), and faster below
    that k (0.90 of ideal against 0.83) and with tool calls, whose continuations then wait behind at most one
    group (0.99 against 0.87). Switch it on for multi-turn tool runs."""

    weight_sync_interval_steps: int = Field(1, ge=1)
    """Engine decode steps between checks for new weights. 1 loads a new version at the next safe point."""

    min_groups_per_request: int = Field(4, ge=1)
    """A worker calls the controller once this many group slots are free or scored groups are ready (or its
    engine is idle), asking for a batch of groups at once; the controller's load then grows with groups, not
    decode steps. Capped at prompts_in_flight. 1 hands over each group at once (lowest latency)."""

    poll_interval_s: float = Field(0.2, gt=0, le=60)
    """Longest a scored group waits at the worker for others to share its controller call, in seconds. New
    weights and the stop flag arrive through a long poll, independent of this."""

    enforce_eager: bool = True
    """Skip CUDA graph capture / compilation (faster start; slower decode on GPUs). True on CPU, which has no CUDA
    graphs; unset with cluster.use_gpus: False (protocols/device_defaults.py). In-place weight loads keep captured
    graphs valid (they copy into the same storage)."""
