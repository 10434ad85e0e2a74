"""The wire format of weight transport: what a sender (learner rank 0) and a receiver (a rollout worker) of any
backend (weights/<type>.py) agree on: tensor metadata, the byte-bucket layout with its checksum, and the
version header. Both sides import it from here; it imports torch only.
"""

import math
import zlib
from dataclasses import dataclass
from typing import Iterable

import torch

_ALIGN = 64  # bytes; every tensor starts aligned in its bucket so dtype views are legal
WIRE_PROTOCOL = 2  # bump when the header or layout changes; a mismatch fails with a clear error
HEADER_LEN = 6  # [protocol, version, num_tensors, layout checksum, delta base version (-1: full), delta bytes]
ALTERNATIVE = "weight_sync.type=object_store needs no process group"


@dataclass(frozen=True)
class WeightMeta:
    """One tensor on the wire, in checkpoint (HF) format."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return math.prod(self.shape) * itemsize


def metas_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[WeightMeta]:
    return [WeightMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named_tensors]


def metas_from_rows(rows: Iterable[tuple[str, str, list[int]]]) -> list[WeightMeta]:
    """Metas from the (name, dtype, shape) rows that cross actor boundaries (LearnerRank.weight_metas)."""
    return [WeightMeta(name, dtype, tuple(shape)) for name, dtype, shape in rows]


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

    def header(self, version: int, base: int = -1, delta_bytes: int = 0) -> torch.Tensor:
        """A full version's header; with `base` >= 0, a delta (weights/delta.py) of `delta_bytes` bytes that
        turns version `base` into `version`."""
        return torch.tensor([WIRE_PROTOCOL, version, len(self.metas), self.checksum, base, delta_bytes],
                            dtype=torch.int64)


def header_bytes(header: torch.Tensor) -> bytes:
    return header.cpu().numpy().tobytes()


def header_from_bytes(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.int64)


def check_header(header: torch.Tensor, layout: BucketLayout) -> int:
    """The version a received header announces; raises if the sender's wire format or layout differ."""
    protocol, version, num_tensors, checksum = (int(x) for x in header.tolist()[:4])
    if protocol != WIRE_PROTOCOL:
        raise RuntimeError(f"weight_sync.type=collective: the learner speaks wire protocol {protocol}, this "
                           f"engine {WIRE_PROTOCOL} (different relayrl versions); update both, or use {ALTERNATIVE}")
    if num_tensors != len(layout.metas) or checksum != layout.checksum:
        raise RuntimeError(f"weight_sync.type=collective: the learner's weight layout ({num_tensors} tensors, "
                           f"checksum {checksum}) differs from this engine's ({len(layout.metas)}, {layout.checksum}); "
                           f"the model or weight_sync.bucket_mb changed after the join; rejoin, or use {ALTERNATIVE}")
    return version


def delta_of(header: torch.Tensor) -> tuple[int, int]:
    """(base version, delta bytes) of a checked header; base -1: a full version in buckets."""
    return int(header[4]), int(header[5])
