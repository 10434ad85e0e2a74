"""Delta encoding of weight versions (`weight_sync.delta`): only the elements whose bits changed since the previous
published version travel. Used by every backend through weights/transport.py (the sender's `publish`
encodes with `PreviousWeights`; a receiver applies a payload with `apply_delta` to its own held copy).

Exact by construction: elements are compared and copied as raw bits (an integer view of the same width), so
-0.0/+0.0, NaN payloads and bf16 rounding all survive, and N deltas on a copy of version v give version v + N bit
for bit. Per tensor the smallest exact form is chosen (sizes for n elements of s bytes, k of them changed):

    unchanged   0 bytes                      (k = 0)
    indices     4k (int32) + s*k             (very few changes)
    gaps        (1 + s)*e                    (a few percent: the distance to the previous change in one byte;
                                              a longer distance adds an entry every 255 elements, which rewrites
                                              an unchanged element with its own bits: e >= k entries)
    bitmask     n/8 + s*k                    (many changes)
    dense       s*n                          (almost all changed: fp32 weights under Adam)
    alias       0 bytes: equal to an earlier tensor of this version (tied lm_head = embed_tokens)

A payload is one flat uint8 tensor: a table (int64 rows of kind, changed count, source index) and then each
tensor's sections, 8-byte aligned, so it goes into one `ray.put` or one byte broadcast unchanged. Torch only.
"""

import math
from typing import Iterable, Iterator

import torch

from protocols.weight_announcement import WeightAnnouncement

UNCHANGED, INDICES, BITMASK, DENSE, ALIAS, GAPS = 0, 1, 2, 3, 4, 5
KIND_NAMES = {UNCHANGED: "unchanged", INDICES: "indices", GAPS: "gaps", BITMASK: "bitmask", DENSE: "dense",
              ALIAS: "alias"}
MAX_GAP = 255  # one byte per entry
FORMAT = 1  # first int64 of every payload; bump when the layout below changes
_ALIGN = 8
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The flat raw bits of a contiguous tensor, as an integer view of the same width (no copy)."""
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


def _pad(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool (n,) -> uint8 (ceil(n/8),), element i at bit i % 8 of byte i // 8."""
    n = mask.numel()
    padded = torch.zeros(_pad(n) if n % 8 else n, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.view(torch.uint8)
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(1, dtype=torch.uint8)[: -(-n // 8)]


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 (ceil(n/8),) -> bool (n,)."""
    weights = _BIT_WEIGHTS.to(packed.device)
    return ((packed.unsqueeze(1) & weights) != 0).reshape(-1)[:n]


def section_bytes(kind: int, n: int, k: int, itemsize: int) -> int:
    """Bytes a tensor of n elements (k changed) takes in a payload with `kind` (sections padded to 8 bytes)."""
    if kind == INDICES:
        return _pad(4 * k) + _pad(itemsize * k)
    if kind == GAPS:  # k: entries here
        return _pad(k) + _pad(itemsize * k)
    if kind == BITMASK:
        return _pad(-(-n // 8)) + _pad(itemsize * k)
    if kind == DENSE:
        return _pad(itemsize * n)
    return 0


def choose_kind(n: int, k: int, itemsize: int, gap_entries: int | None = None) -> int:
    """The smallest exact form for n elements of which k changed (int32 indices need n < 2**31); `gap_entries`:
    the entries the gaps form would take (None: not considered)."""
    if k == 0:
        return UNCHANGED
    sizes = {BITMASK: section_bytes(BITMASK, n, k, itemsize), DENSE: section_bytes(DENSE, n, k, itemsize)}
    if n < 2**31:
        sizes[INDICES] = section_bytes(INDICES, n, k, itemsize)
    if gap_entries is not None:
        sizes[GAPS] = section_bytes(GAPS, n, gap_entries, itemsize)
    return min(sizes, key=sizes.get)


def gap_positions(index: torch.Tensor) -> torch.Tensor:
    """The positions the gaps form sends for sorted changed positions `index`: each change, plus one entry every
    MAX_GAP elements of a longer run without one (those rewrite an unchanged element; the result stays exact)."""
    gaps = torch.diff(index, prepend=index.new_full((1,), -1))
    counts = (gaps + MAX_GAP - 1) // MAX_GAP
    steps = torch.full((int(counts.sum()),), MAX_GAP, dtype=torch.int64)
    steps[counts.cumsum(0) - 1] = gaps - MAX_GAP * (counts - 1)
    return steps.cumsum(0) - 1


def _gap_bytes(positions: torch.Tensor) -> torch.Tensor:
    return torch.diff(positions, prepend=positions.new_full((1,), -1)).to(torch.uint8)


class PreviousWeights:
    """The sender's host copy of the last published version (one model copy in host memory, never on the GPU),
    and the encoder of the next version against it. `record` fills it from a full version as it is sent;
    `encode` builds the delta of a new version and updates the copy to it."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        """The version the copy holds; None: nothing published yet (or reset), so the next version goes in full."""
        self._scratch: torch.Tensor | None = None
        self.last_stats: dict = {}

    def reset(self) -> None:
        """Forget the copy (a new weight group, a failed send): the next publish is a full version."""
        self.tensors.clear()
        self.version = None

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _on_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous host view of `tensor`: itself on CPU; from a GPU, a copy into one reused scratch buffer."""
        tensor = tensor.detach()
        if not tensor.is_cuda:
            return tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        if self._scratch is None or self._scratch.numel() < size:
            self._scratch = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host = self._scratch[:size].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)  # synchronous: the gathered tensor may be freed once the iterator moves on
        return host

    def _store(self, name: str, host: torch.Tensor) -> None:
        held = self.tensors.get(name)
        if held is None or held.shape != host.shape or held.dtype != host.dtype:
            self.tensors[name] = host.clone()
        else:
            held.copy_(host)

    def record(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass `weights` through unchanged while copying each into the host copy; the copy holds `version` once
        the iterator is exhausted."""
        self.version = None
        seen = set()
        for name, tensor in weights:
            self._store(name, self._on_host(tensor))
            seen.add(name)
            yield name, tensor
        for name in set(self.tensors) - seen:
            del self.tensors[name]
        self.version = version

    def encode(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> torch.Tensor:
        """The delta payload from the held version to `weights` (same names, order, shapes and dtypes as the
        version recorded; raises otherwise), and the copy updated to `version`. `last_stats` says what was sent."""
        if self.version is None:
            raise RuntimeError("no previous version to encode a delta against; publish a full version first")
        rows, sections, changed, total = [], [], 0, 0
        order: list[str] = []
        storage: dict[tuple, int] = {}  # (data pointer, shape, dtype) of this version's tensors -> first index
        kinds = dict.fromkeys(KIND_NAMES.values(), 0)
        self.version = None  # half-updated until the loop ends
        for index, (name, tensor) in enumerate(weights):
            prev = self.tensors.get(name)
            cur = self._on_host(tensor)
            if prev is None or prev.shape != cur.shape or prev.dtype != cur.dtype:
                raise ValueError(f"weight {name} {tuple(cur.shape)} {cur.dtype} does not match the previous "
                                 f"version's ({None if prev is None else (tuple(prev.shape), prev.dtype)}); the "
                                 "model changed between two publishes, so the next version must go in full")
            order.append(name)
            cur_bits, prev_bits = bits(cur), bits(prev)
            n, itemsize = cur_bits.numel(), cur.element_size()
            total += n
            key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device)
            source = storage.setdefault(key, index)
            # a tensor that shares an earlier one's storage (tied lm_head) is sent as a reference when it is still
            # equal to it bit for bit (checked: exactness never rests on the pointer)
            source = source if source != index and torch.equal(bits(self.tensors[order[source]]), cur_bits) else None
            if source is not None:
                mask_k = int(torch.count_nonzero(cur_bits != prev_bits))
                changed += mask_k
                prev.copy_(cur)
                rows.append((ALIAS, mask_k, source))
                kinds["alias"] += 1
                continue
            mask = cur_bits != prev_bits
            k = int(torch.count_nonzero(mask))  # bool .sum() is 100x slower on CPU
            changed += k
            index_tensor = positions = None
            if 0 < k and section_bytes(INDICES, n, k, itemsize) < section_bytes(BITMASK, n, k, itemsize) * 2:
                # few enough changes that a form listing them may win: count what the gaps form would take
                index_tensor = mask.nonzero().reshape(-1)
                positions = gap_positions(index_tensor)
            kind = choose_kind(n, k, itemsize, None if positions is None else positions.numel())
            kinds[KIND_NAMES[kind]] += 1
            rows.append((kind, positions.numel() if kind == GAPS else k, -1))
            if kind == GAPS:
                values = cur_bits[positions]
                sections += [_gap_bytes(positions), _as_bytes(values)]
                prev_bits[positions] = values
            elif kind == INDICES:
                values = cur_bits[index_tensor]
                sections += [_as_bytes(index_tensor.to(torch.int32)), _as_bytes(values)]
                prev_bits[index_tensor] = values
            elif kind == BITMASK:
                sections += [pack_bits(mask), _as_bytes(cur_bits[mask])]
                prev.copy_(cur)
            elif kind == DENSE:
                sections.append(_as_bytes(cur_bits).clone())
                prev.copy_(cur)
        if sorted(order) != sorted(self.tensors):
            raise ValueError(f"this version has {len(order)} tensors, the previous one {len(self.tensors)}; the "
                             "model changed between two publishes, so the next version must go in full")
        table = torch.tensor([[FORMAT, len(rows), 0]] + [list(r) for r in rows], dtype=torch.int64)
        parts = [_as_bytes(table)]
        for section in sections:
            parts.append(section)
            if section.numel() % _ALIGN:
                parts.append(torch.zeros(_ALIGN - section.numel() % _ALIGN, dtype=torch.uint8))
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        self.version = version
        self.last_stats = {"changed_elements": changed, "elements": total, "payload_bytes": payload.numel(),
                           "kinds": kinds}
        return payload

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.tensors.items())


def apply_delta(held: list[tuple[str, torch.Tensor]], payload: torch.Tensor) -> None:
    """Update `held` (the receiver's copy of the base version, (name, tensor) in the sender's order, contiguous,
    on any device) in place to the payload's version. `payload` is a flat uint8 tensor on the same device."""
    rows_header = payload[:3 * 8].view(torch.int64).tolist()
    if rows_header[0] != FORMAT:
        raise RuntimeError(f"weight delta payload has format {rows_header[0]}, this receiver reads {FORMAT} "
                           "(different relayrl versions on the learner and the engine); update both")
    num = rows_header[1]
    if num != len(held):
        raise RuntimeError(f"weight delta payload covers {num} tensors, the engine holds {len(held)}; the model "
                           "changed after the last full version")
    table = payload[3 * 8:(num + 1) * 3 * 8].view(torch.int64).view(num, 3).tolist()
    offset = (num + 1) * 3 * 8
    for (name, tensor), (kind, k, source) in zip(held, table):
        flat = bits(tensor)
        n, itemsize = flat.numel(), tensor.element_size()
        if kind == GAPS:  # k entries
            positions = payload[offset: offset + k].long().cumsum(0) - 1
            offset += _pad(k)
            flat[positions] = payload[offset: offset + itemsize * k].view(flat.dtype)
            offset += _pad(itemsize * k)
        elif kind == INDICES:
            index = payload[offset: offset + 4 * k].view(torch.int32).long()
            offset += _pad(4 * k)
            flat[index] = payload[offset: offset + itemsize * k].view(flat.dtype)
            offset += _pad(itemsize * k)
        elif kind == BITMASK:
            mask = unpack_bits(payload[offset: offset + -(-n // 8)], n)
            offset += _pad(-(-n // 8))
            flat.masked_scatter_(mask, payload[offset: offset + itemsize * k].view(flat.dtype))
            offset += _pad(itemsize * k)
        elif kind == DENSE:
            flat.copy_(payload[offset: offset + itemsize * n].view(flat.dtype))
            offset += _pad(itemsize * n)
        elif kind == ALIAS:
            flat.copy_(bits(held[source][1]))
        elif kind != UNCHANGED:
            raise RuntimeError(f"weight delta payload: tensor {name} has unknown kind {kind}")
    if offset != payload.numel():
        raise RuntimeError(f"weight delta payload has {payload.numel()} bytes, its table describes {offset}")


def delta_ratio(payload_bytes: int, dense_bytes: int) -> float:
    """Dense bytes over delta bytes (how many times smaller the delta is)."""
    return dense_bytes / payload_bytes if payload_bytes else math.inf


def delta_metrics(announcement: WeightAnnouncement) -> dict[str, float]:
    """For metrics.jsonl: weights/delta_full (1 when the version went in full: the first one, or after a new
    group) and weights/changed_frac (elements changed since the previous version); {} when weight_sync is dense."""
    stats = announcement.delta
    if stats is None:
        return {}
    if stats.base_version is None:
        return {"weights/delta_full": 1.0}
    return {"weights/delta_full": 0.0, "weights/changed_frac": stats.changed_elements / max(stats.elements, 1)}
