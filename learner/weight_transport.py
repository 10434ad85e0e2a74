"""The sender side of weight transport (learner rank 0) and the wire format both sides agree on.

Two backends, chosen by `weight_sync.type`: `object_store` packs the weights into reusable host buffers for one
`ray.put` per version (the Ray call lives in learner_actor.py); `collective` broadcasts them in byte buckets over
a torch.distributed group of its own. The receiving side (actors/weight_receiver.py) knows only the wire format
defined here (`WeightMeta`, `BucketLayout`, the header), never the sender's classes. Torch and numpy only.
Tied embeddings: both `embed_tokens` and `lm_head` are sent, because vLLM's CPU backend keeps a separately
repacked `lm_head` that is stale unless it is loaded too.
"""

import time
from typing import Iterable, Iterator

import numpy as np
import torch

from learner.weight_wire import BITCAST, BucketLayout, header_bytes, header_key


# --- object store: packing into reusable host buffers --------------------------------------------------------
def _to_numpy(tensor: torch.Tensor) -> tuple[str, np.ndarray]:
    dtype = tensor.dtype
    if dtype in BITCAST:
        tensor = tensor.view(BITCAST[dtype])
    return str(dtype).removeprefix("torch."), tensor.numpy()


def pack_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (torch dtype name, numpy array). Tensors are copied to CPU and made contiguous."""
    return {name: _to_numpy(t.detach().to("cpu").contiguous()) for name, t in state_dict.items()}


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


class BroadcastFailed(RuntimeError):
    """A weight broadcast failed: a member of the weight group is gone (a dead rollout engine closes its
    connections) or passed weight_sync.timeout_s. The group is unusable afterwards; the supervisor replaces the
    dead engine, opens a new group and sends again."""


class CollectiveSender:
    """Broadcasts weights from group rank 0 in byte buckets. `group` is a torch.distributed ProcessGroup that
    holds only the learner's rank 0 and the engines (never DeepSpeed's default group); `store` is its TCPStore,
    through which each broadcast is announced (a header: protocol, version, tensor count, layout checksum).

    Buckets live on the parameters' device, so on GPUs a parameter is copied device-to-device into a bucket and
    NCCL sends it: no host copy. Two buckets alternate so filling one overlaps the broadcast of the other.
    """

    def __init__(self, group, store, layout: BucketLayout, device: torch.device, timeout_s: float) -> None:
        self.group = group
        self.store = store
        self.seq = 0
        self.layout = layout
        self.device = device
        self.timeout_s = timeout_s
        self._flats = [torch.empty(max(layout.bucket_sizes), dtype=torch.uint8, device=device)
                       for _ in range(min(2, len(layout.buckets)))]

    def _broadcast(self, tensor: torch.Tensor):
        return self.group.broadcast(tensor, 0)

    def send(self, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> dict:
        """Broadcast one version. `named_tensors` yields tensors in the layout's order (checked)."""
        start = time.perf_counter()
        self.seq += 1
        self.store.set(header_key(self.seq), header_bytes(self.layout.header(version)))
        it = iter(named_tensors)
        try:
            self._send_buckets(it)
        except BroadcastFailed:
            # The other learner ranks sit in this iterator's ZeRO-3 gathers: finish them, so a retry on a new group
            # (cluster/supervisor.py) starts all ranks at the first gather together.
            for _ in it:
                pass
            raise
        for _ in it:  # let a layer-by-layer gather finish its collectives
            pass
        seconds = time.perf_counter() - start
        return {"num_tensors": len(self.layout.metas), "num_bytes": self.layout.num_bytes, "seconds": seconds}

    def _send_buckets(self, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        pending = [None] * len(self._flats)
        for b, entries in enumerate(self.layout.buckets):
            slot = b % len(self._flats)
            if pending[slot] is not None:
                self._wait(pending[slot], f"bucket {b - len(self._flats)}")
            flat = self._flats[slot]
            for i, offset in entries:
                meta = self.layout.metas[i]
                name, tensor = next(it)
                if name != meta.name or tuple(tensor.shape) != meta.shape:
                    raise ValueError(f"weight {i} is {name} {tuple(tensor.shape)} but the layout the engines "
                                     f"joined with says {meta.name} {meta.shape}; rejoin the weight group after a "
                                     "model change")
                flat[offset: offset + meta.num_bytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            size = self.layout.bucket_sizes[b]
            try:
                pending[slot] = self._broadcast(flat[:size])
            except RuntimeError as err:  # gloo may refuse at once a pair whose peer already closed it
                raise self._failed(f"bucket {b}", err) from err
        for work in pending:
            if work is not None:
                self._wait(work, "last buckets")

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise self._failed(what, err) from err

    def _failed(self, what: str, err: BaseException) -> "BroadcastFailed":
        return BroadcastFailed(
            f"weight_sync.type=collective: broadcast of the {what} failed or passed weight_sync.timeout_s="
            f"{self.timeout_s}: {err}. A rollout engine left the weight group or stopped receiving; "
            "weight_sync.type=object_store needs no group")
