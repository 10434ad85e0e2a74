"""The `object_store` weight transport (the default): learner rank 0 packs the weights into reusable host buffers
for one `ray.put` per version; the announcement carries the object ref, and each rollout worker maps it (zero-copy
on the node) and loads it. Needs nothing beyond Ray and works across nodes. Ray is imported inside the methods.
On the wire: name -> (torch dtype name, numpy array); bf16 travels as int16 bits, since numpy has no bf16.
Tied embeddings: both `embed_tokens` and `lm_head` are sent, because vLLM's CPU backend keeps a separately
repacked `lm_head` that is stale unless it is loaded too.

With weight_sync.delta every worker reads the same refs but may hold a different version (it loads the newest when
it is ready, and a replaced worker holds none), so a version is announced as a chain: the latest full version
(a keyframe) and the deltas after it, each tagged with its base version. A worker applies the deltas from the
version it holds, or loads the keyframe first when it holds none of the chain's versions. A new keyframe is put
(beside that version's delta) once the deltas since the last one add up to its size, so the store holds at most
about two model copies (keyframe + deltas) against one when dense, and a worker catching up reads at most that.
"""

import os
import time
import warnings
from typing import Iterable

import numpy as np
import torch

from protocols.weight_announcement import WeightAnnouncement
from weights.transport import NamedTensors, WeightBackend, WeightReceiver, WeightSender, apply_delta

BITCAST = {torch.bfloat16: torch.int16}


# --- the packed form: packing into reusable host buffers, and back --------------------------------------------
def _to_numpy(tensor: torch.Tensor) -> tuple[str, np.ndarray]:
    dtype = tensor.dtype
    if dtype in BITCAST:
        tensor = tensor.view(BITCAST[dtype])
    return str(dtype).removeprefix("torch."), tensor.numpy()


def pack_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (torch dtype name, numpy array). Tensors are copied to CPU and made contiguous."""
    return {name: _to_numpy(t.detach().to("cpu").contiguous()) for name, t in state_dict.items()}


def unpack_state_dict(packed: dict[str, tuple[str, np.ndarray]]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of packing, as (name, tensor) pairs in checkpoint format. Shares memory with the arrays."""
    out = []
    for name, (dtype_name, array) in packed.items():
        with warnings.catch_warnings():
            # Arrays from the Ray object store are read-only views; the engine copies them into its own
            # parameters, so no copy is made here.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        dtype = getattr(torch, dtype_name)
        if dtype in BITCAST:
            tensor = tensor.view(dtype)
        out.append((name, tensor))
    return out


class HostBuffers:
    """Host copies of the weights in buffers allocated once and reused every version.

    From a GPU the buffers are page-locked, so `copy_(non_blocking=True)` runs as DMA and one synchronize at the
    end waits for all of them (measured for the 1.5B shape on an H100: 2.8 s with fresh `.cpu()` copies, 0.067 s
    into reused pinned buffers). On CPU reuse avoids first-touch page faults of fresh memory each version.
    The returned arrays alias the buffers: hand them to `ray.put` (which copies) before the next `pack`.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=self.pin_memory)
            self._buffers[name] = buf
            self.allocations += 1
        return buf

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[str, np.ndarray]]:
        """Copy each (name, tensor) into its buffer; returns name -> (dtype name, numpy view of the buffer).

        The iterator may free a tensor once it advances (ZeRO-3 gathers a bucket at a time): GPU copies are
        enqueued on the current stream, so they run before any later reuse of that memory on the stream, and
        the iterator synchronizes before it releases a gather. One synchronize at the end waits for the rest.
        """
        packed = {}
        any_cuda = False
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            buf = self._buffer(name, tensor)
            any_cuda |= tensor.is_cuda
            buf.copy_(tensor, non_blocking=tensor.is_cuda and self.pin_memory)
            packed[name] = buf
        if any_cuda:
            torch.cuda.synchronize()
        return {name: _to_numpy(buf) for name, buf in packed.items()}

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def host_arrays(named_tensors: Iterable[tuple[str, torch.Tensor]],
                buffers: HostBuffers | None) -> dict[str, tuple[str, np.ndarray]]:
    """What the object-store sender puts: name -> (dtype name, array). With `buffers`, copies into them (GPU
    weights, or ZeRO-3 gathers that are freed as the iterator moves on); without, numpy views of the tensors
    themselves, for weights already in host memory that stay alive until the `ray.put`, which copies once."""
    if buffers is not None:
        return buffers.pack(named_tensors)
    return {name: _to_numpy(tensor.detach()) for name, tensor in named_tensors}


def host_copy_seconds(named_tensors: Iterable[tuple[str, torch.Tensor]], buffers: HostBuffers) -> float:
    """Time one `HostBuffers.pack` (the object-store sender's host copy); for timing on a GPU without Ray/vLLM."""
    start = time.perf_counter()
    buffers.pack(named_tensors)
    return time.perf_counter() - start


def packed_num_bytes(packed: dict[str, tuple[str, np.ndarray]]) -> int:
    return sum(array.nbytes for _, array in packed.values())


# --- the two sides --------------------------------------------------------------------------------------------
class ObjectStoreSender(WeightSender):
    type = "object_store"

    def __init__(self, cfg, on_gpu: bool) -> None:
        super().__init__(cfg, on_gpu)
        # CPU parameters under ZeRO-2 are host memory already and stay put until the put returns: no extra copy.
        # GPU weights and ZeRO-3 gathers (freed as the iterator moves on) are copied into reused host buffers.
        reuse = on_gpu or cfg.learner.zero_stage == 3
        self.host_buffers = HostBuffers(pin_memory=on_gpu) if reuse else None
        self.keyframe: tuple | None = None
        """weight_sync.delta: ("full", lineage, version, -1, ref, bytes) of the latest full version."""
        self.deltas: list[tuple] = []
        """("delta", lineage, version, base, ref, bytes) since the keyframe (and the keyframe version's own)."""
        self.lineage = ""

    def send(self, weights: NamedTensors, version: int) -> WeightAnnouncement:
        import ray

        if self.previous is not None:
            # weight_sync.delta: `weights` fills the host copy as it is read (WeightSender.publish); put that copy,
            # rather than packing a second one into the host buffers
            for _ in weights:
                pass
            weights = iter(self.previous.items())
        packed = host_arrays(weights, self.host_buffers if self.previous is None else None)
        ref = ray.put(packed)
        num_bytes = packed_num_bytes(packed)
        if self.previous is None:
            return WeightAnnouncement(version=version, refs=[ref], num_tensors=len(packed), num_bytes=num_bytes)
        # a new lineage: versions of an earlier one (before a failed send) never chain into this one
        self.lineage = os.urandom(8).hex()
        self.keyframe, self.deltas = ("full", self.lineage, version, -1, ref, num_bytes), []
        return WeightAnnouncement(version=version, refs=self._chain(), num_tensors=len(packed), num_bytes=num_bytes)

    def send_delta(self, payload: torch.Tensor, version: int, base: int) -> WeightAnnouncement:
        import ray

        if payload.numel() >= self.keyframe[-1]:
            # The changes are as large as the whole version (every element moved: a LoRA adapter under AdamW, fp32
            # weights under Adam): put the version whole as the new keyframe, not a delta beside a new keyframe
            # (twice the bytes). A worker at `base` reads the keyframe, as many bytes as the delta would be.
            packed = host_arrays(iter(self.previous.items()), None)
            self.keyframe = ("full", self.lineage, version, -1, ray.put(packed), packed_num_bytes(packed))
            self.deltas = []
            return WeightAnnouncement(version=version, refs=self._chain(), num_tensors=len(self.previous.tensors),
                                      num_bytes=self.keyframe[-1])
        self.deltas.append(("delta", self.lineage, version, base, ray.put(payload.numpy()), payload.numel()))
        num_bytes = payload.numel()
        if sum(d[-1] for d in self.deltas) >= self.keyframe[-1]:
            # The host copy holds this version now: put it as the new keyframe (no extra copy; ray.put copies).
            packed = host_arrays(iter(self.previous.items()), None)
            self.keyframe = ("full", self.lineage, version, -1, ray.put(packed), packed_num_bytes(packed))
            self.deltas = self.deltas[-1:]  # a worker one version behind still reads only the delta
            num_bytes += self.keyframe[-1]
        return WeightAnnouncement(version=version, refs=self._chain(), num_tensors=len(self.previous.tensors),
                                  num_bytes=num_bytes)

    def _chain(self) -> list[tuple]:
        return [self.keyframe, *self.deltas]


class ObjectStoreReceiver(WeightReceiver):
    type = "object_store"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.held: list[tuple[str, torch.Tensor]] | None = None
        """weight_sync.delta: this worker's own copy of the version it loaded last (one model copy in host memory),
        which the deltas update."""
        self.held_key: tuple[str, int] | None = None  # (lineage, version) of `held`
        self.read_bytes = 0
        """Bytes this worker read from the object store (over the network when the learner is on another node)."""

    def direct_refs(self, announcement: WeightAnnouncement) -> list | None:
        """Dense: the one ref the sender put, which every tensor-parallel worker maps itself. With
        weight_sync.delta the version is this worker's held copy (`stage`), so None."""
        refs = announcement.refs
        if not refs or isinstance(refs[0], tuple):
            return None
        self.read_bytes += announcement.num_bytes
        return refs[:1]

    def stage(self, announcement: WeightAnnouncement) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """(version, checkpoint-format pairs) of the announced weights; dense, the pairs map the object store."""
        import ray

        version, refs = announcement.version, announcement.refs
        if not refs:
            raise RuntimeError(f"weight version {version} was announced without an object ref; the learner and "
                               "this worker disagree on weight_sync.type")
        if isinstance(refs[0], tuple):
            return self._stage_chain(refs)
        packed = ray.get(refs[0])
        self.read_bytes += announcement.num_bytes  # the sender counted the packed bytes it put
        return version, unpack_state_dict(packed)

    def _stage_chain(self, chain: list[tuple]) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Bring the held copy to the chain's newest version: the deltas from the held version when the chain
        has them all, else the keyframe first."""
        import ray

        (_, lineage, keyframe_version, _, keyframe_ref, keyframe_bytes), deltas = chain[0], chain[1:]
        by_base = {base: (v, ref, size) for _, line, v, base, ref, size in deltas if line == lineage}
        target = max([keyframe_version] + [v for v, _, _ in by_base.values()])
        held = self.held_key[1] if self.held is not None and self.held_key[0] == lineage else None
        while held is not None and held < target and held in by_base:
            held = by_base[held][0]
        if held != target:  # new, or behind the chain: the full version, then every delta after it
            packed = ray.get(keyframe_ref)
            self.read_bytes += keyframe_bytes
            self.held = [(name, tensor.clone()) for name, tensor in unpack_state_dict(packed)]
            del packed
            self.held_key = (lineage, keyframe_version)
        while self.held_key[1] < target:
            v, ref, size = by_base[self.held_key[1]]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only view: apply_delta only reads it
                payload = torch.from_numpy(ray.get(ref))
            self.read_bytes += size
            apply_delta(self.held, payload)
            self.held_key = (lineage, v)
        return target, self.held


BACKEND = WeightBackend("object_store", ObjectStoreSender, ObjectStoreReceiver)
