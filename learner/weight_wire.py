"""The wire format of weight transport, the one thing the sender (learner/weight_transport.py) and the receivers
(actors/weight_receiver.py) share: tensor metadata, the byte-bucket layout, the version header, and how a
weight group (a torch.distributed group apart from DeepSpeed's) is opened with a timeout. Torch and numpy only.
"""

import warnings
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable

import numpy as np
import torch

BITCAST = {torch.bfloat16: torch.int16}  # numpy has no bf16: it travels as int16 bits through the object store
_ALIGN = 64  # bytes; every tensor starts aligned in its bucket so dtype views are legal
WIRE_PROTOCOL = 1  # bump when the header or layout changes; a mismatch fails with a clear error
HEADER_LEN = 4  # [protocol, version, num_tensors, layout checksum]
ALTERNATIVE = "weight_sync.type=object_store needs no process group"


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


@dataclass(frozen=True)
class WeightMeta:
    """One tensor on the wire, in checkpoint (HF) format."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize


def metas_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[WeightMeta]:
    return [WeightMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named_tensors]


class BucketLayout:
    """Where each tensor sits in the byte buckets: tensors in order, a new bucket when the next one would not fit
    (a tensor bigger than a bucket gets one of its own). Both sides compute it from the same metas and size."""

    def __init__(self, metas: list[WeightMeta], bucket_bytes: int) -> None:
        self.metas = list(metas)
        self.bucket_bytes = bucket_bytes
        self.buckets: list[list[tuple[int, int]]] = []  # per bucket: (meta index, byte offset)
        self.bucket_sizes: list[int] = []
        offset = 0
        for i, meta in enumerate(self.metas):
            size = meta.num_bytes
            if not self.buckets or (offset > 0 and offset + size > bucket_bytes):
                self.buckets.append([])
                self.bucket_sizes.append(0)
                offset = 0
            self.buckets[-1].append((i, offset))
            offset += -(-size // _ALIGN) * _ALIGN
            self.bucket_sizes[-1] = offset
        text = "|".join(f"{m.name}:{m.dtype}:{m.shape}" for m in self.metas) + f"|{bucket_bytes}"
        # crc32 fits an int64 header slot; it changes with any name, dtype, shape or bucket size.
        self.checksum = zlib.crc32(text.encode())

    @property
    def num_bytes(self) -> int:
        return sum(m.num_bytes for m in self.metas)

    def views(self, bucket: int, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views of one received byte bucket, in checkpoint format."""
        out = []
        for i, offset in self.buckets[bucket]:
            meta = self.metas[i]
            raw = flat[offset: offset + meta.num_bytes]
            out.append((meta.name, raw.view(getattr(torch, meta.dtype)).view(meta.shape)))
        return out

    def header(self, version: int) -> torch.Tensor:
        return torch.tensor([WIRE_PROTOCOL, version, len(self.metas), self.checksum], dtype=torch.int64)




def header_key(seq: int) -> str:
    """The store key announcing the `seq`-th broadcast (1, 2, ...). The announcement travels through the store,
    not the group: a receiver may wait for the next version for as long as the learner trains, and a collective
    left pending that long would hit the group's timeout (and on NCCL hold a kernel on the GPU)."""
    return f"header/{seq}"


def header_bytes(header: torch.Tensor) -> bytes:
    return header.cpu().numpy().tobytes()


def header_from_bytes(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype=np.int64).copy())


def open_weight_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                      device: torch.device | None = None):
    """(group, store): a standalone ProcessGroup on a TCPStore at host:port (rank 0 serves the store). It is not
    registered as torch.distributed's default group, so it never mixes with DeepSpeed's collectives.

    Raises RuntimeError naming `weight_sync` settings when the store cannot be reached or bound (port in use)
    or the peers do not all arrive within `timeout_s`.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                              wait_for_workers=True)
        store = dist.PrefixStore("relayrl_weights", store)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            if device is not None:
                # NCCL builds its communicator lazily; one tiny collective now surfaces join errors here.
                group.broadcast(torch.zeros(1, device=device), 0).wait()
        else:
            raise ValueError(f"weight_sync.backend={backend!r}; allowed: gloo, nccl")
    except (RuntimeError, ValueError, OSError) as err:
        raise RuntimeError(
            f"weight_sync.type=collective: rank {rank} of {world_size} could not join the weight group at "
            f"{host}:{port} (backend {backend}) within weight_sync.timeout_s={timeout_s}: {err}. Check that "
            f"every rollout engine started and the port is free and reachable, raise weight_sync.timeout_s, "
            f"or use {ALTERNATIVE}") from err
    return group, store


def check_header(header: torch.Tensor, layout: BucketLayout) -> int:
    """The version a received header announces; raises if the sender's wire format or layout differ."""
    protocol, version, num_tensors, checksum = (int(x) for x in header.tolist())
    if protocol != WIRE_PROTOCOL:
        raise RuntimeError(f"weight_sync.type=collective: the learner speaks wire protocol {protocol}, this "
                           f"engine {WIRE_PROTOCOL} (different relayrl versions); update both, or use {ALTERNATIVE}")
    if num_tensors != len(layout.metas) or checksum != layout.checksum:
        raise RuntimeError(f"weight_sync.type=collective: the learner's weight layout ({num_tensors} tensors, "
                           f"checksum {checksum}) differs from this engine's ({len(layout.metas)}, {layout.checksum}); "
                           f"the model or weight_sync.bucket_mb changed after the join; rejoin, or use {ALTERNATIVE}")
    return version
