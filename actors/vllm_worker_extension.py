"""The vLLM worker extension through which new weights reach every tensor-parallel worker of an engine.

vLLM mixes `WeightLoader` into its worker class (`LLM(..., worker_extension_cls=EXTENSION)`, see
actors/vllm_weights.py `weight_loader_engine_args`), so `collective_rpc("relayrl_load_weights", args=(message,))`
runs in each TP worker. The message is a control message only (a few hundred bytes): the version, and where the
weights are. Each worker reads them itself and loads them with vLLM's in-place reload in checkpoint format, which
shards and repacks them for that worker:

- `objects`: Ray object handles (`object_handles`) of what the object-store sender puts (name -> (dtype, array),
  weights/object_store.py). Each worker maps the object from the node's object store: zero-copy on a node, at every
  TP size. A worker that is not a Ray process (vLLM's `mp` executor, the CPU path at TP > 1) connects to the
  cluster once, at its first load.
- `tensors`: the (name, tensor) pairs themselves, only for an in-process engine (TP = 1, the `uni` executor): its
  RPC is a plain call in this process, so nothing is copied or serialized.

Ray is imported inside the functions: this module is imported by every vLLM worker process.
"""

import time

EXTENSION = "actors.vllm_worker_extension.WeightLoader"
"""The `worker_extension_cls` every relayrl engine starts with."""

LOAD_METHOD = "relayrl_load_weights"
"""The RPC name. vLLM refuses an extension whose names the worker already has (the CPU worker defines
`update_weights`, vLLM's own weight-transfer call), so every name here starts with `relayrl_`."""

TESTED_RAY = "2.60.0"


def object_handles(refs: list) -> list[tuple[bytes, bytes, bytes]]:
    """(object id, owner address, object status) of each ref, for a process that is handed them by pickle.

    vLLM pickles RPC arguments with the standard pickler (a message queue to `mp` and Ray workers alike), which
    writes an ObjectRef as its id alone: a worker could not find the object's owner. Ray's own out-of-band
    serialization (cloudpickle) carries the owner but pins the object for the sender's lifetime, one model copy
    leaked per version. These triples are what Ray's in-band serializer writes, without the pin: the rollout worker
    holds the announcement's refs until every TP worker's load has returned, which keeps the objects alive."""
    import ray

    core = ray._private.worker.global_worker.core_worker
    handles = []
    for ref in refs:
        try:
            _, owner, status = core.serialize_object_ref(ref)
        except AttributeError as err:
            raise RuntimeError(f"Ray {ray.__version__} has no CoreWorker.serialize_object_ref, which relayrl's "
                               f"weight loads use (tested: Ray {TESTED_RAY}); install the tested Ray") from err
        handles.append((ref.binary(), owner, status))
    return handles


def objects_from_handles(handles: list[tuple[bytes, bytes, bytes]], ray_address: str) -> list:
    """The objects of `object_handles`, read in this process (mapped from the node's object store, not copied).
    Connects this process to the cluster at `ray_address` first when it is not a Ray process yet."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ray_address, logging_level="ERROR", log_to_driver=False)
    from ray._private.serialization import _object_ref_deserializer  # Ray's own reader of the triples above

    refs = [_object_ref_deserializer(binary, "", owner, status, None) for binary, owner, status in handles]
    return ray.get(refs)


def message_weights(message: dict) -> tuple[list, list]:
    """(checkpoint-format pairs, what must stay alive while they are loaded) of a load message."""
    if "tensors" in message:
        return list(message["tensors"]), []
    from weights.object_store import unpack_state_dict

    packed = objects_from_handles(message["objects"], message["ray_address"])
    return [pair for part in packed for pair in unpack_state_dict(part)], packed


class WeightLoader:
    """Mixed into each vLLM worker (every TP rank). Holds no state of its own: the worker's model is the state."""

    def relayrl_load_weights(self, message: dict) -> dict:
        """Load the version `message` names into this worker's model in place. `message["skip"]` (tests only,
        `RolloutWorker.inject_weight_fault`): leave out the tensors whose names start with it. Returns what this
        worker loaded: {version, tensors, bytes, seconds}."""
        start = time.perf_counter()
        weights, keep_alive = message_weights(message)
        skip = message.get("skip")
        if skip:
            weights = [(name, tensor) for name, tensor in weights if not name.startswith(skip)]
        # checkpoint format: vLLM's weight loaders shard each tensor for this rank and fuse/repack it (the CPU
        # backend repacks, so a plain model.load_weights fails there); a tied model gets lm_head too, since the
        # CPU backend's repacked lm_head is stale unless it is loaded (weights/object_store.py)
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        loaded = {"version": message["version"], "tensors": len(weights),
                  "bytes": sum(tensor.numel() * tensor.element_size() for _, tensor in weights)}
        del weights, keep_alive  # the engine copied them: release the object-store mappings now
        return {**loaded, "seconds": time.perf_counter() - start}
