"""Delta encoding of weight versions (learner/weight_delta.py) without Ray or vLLM: exact round trips of raw bits
in fp32 and bf16, for sparse, dense, empty and aliased changes, and the size of each form."""

import pytest
import torch

from learner.weight_delta import (ALIAS, BITMASK, DENSE, INDICES, UNCHANGED, PreviousWeights, apply_delta, bits,
                                  choose_kind, pack_bits, section_bytes, unpack_bits)


def _model(seed: int, dtype: torch.dtype, tied: bool = True) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 16, generator=g).to(dtype)
    out = [("embed", embed), ("w", torch.randn(32, 16, generator=g).to(dtype)),
           ("bias", torch.randn(16, generator=g).to(dtype))]
    return out + [("lm_head", embed if tied else torch.randn(64, 16, generator=g).to(dtype))]


def _step(weights, fraction: float, seed: int):
    """A new version: each element moves by one ulp-scale nudge with probability `fraction` (tied stays tied)."""
    g = torch.Generator().manual_seed(seed)
    out, done = [], {}
    for name, t in weights:
        if id(t) in done:
            out.append((name, done[id(t)]))
            continue
        mask = torch.rand(t.shape, generator=g) < fraction
        new = torch.where(mask, (t.float() * 1.01 + 1e-3).to(t.dtype), t)
        done[id(t)] = new
        out.append((name, new))
    return out


def _held(weights):
    return [(name, t.clone()) for name, t in weights]


def _same_bits(a, b) -> bool:
    return all(na == nb and torch.equal(bits(ta.contiguous()), bits(tb.contiguous())) for (na, ta), (nb, tb) in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_deltas_reproduce_every_version_bit_for_bit(dtype, fraction):
    prev = PreviousWeights()
    version = _model(0, dtype)
    list(prev.record(iter(version), 1))
    held = _held(version)  # the receiver got version 1 in full
    for v in range(2, 7):
        version = _step(version, fraction, seed=v)
        payload = prev.encode(iter(version), v)
        apply_delta(held, payload)
        assert _same_bits(held, version), f"{dtype} fraction {fraction}: version {v} differs after the delta"
        assert prev.version == v and _same_bits(prev.items(), version)


def test_an_empty_change_is_a_table_only():
    prev = PreviousWeights()
    weights = _model(0, torch.bfloat16)
    list(prev.record(iter(weights), 1))
    payload = prev.encode(iter(weights), 2)
    # header row + 4 rows of 3 int64: 5 * 24 bytes, no sections
    assert payload.numel() == 5 * 24 and prev.last_stats["changed_elements"] == 0
    assert prev.last_stats["kinds"]["unchanged"] == 3 and prev.last_stats["kinds"]["alias"] == 1
    held = _held(weights)
    apply_delta(held, payload)
    assert _same_bits(held, weights)


def test_signed_zero_and_nan_payloads_survive():
    # -0.0 == 0.0 and NaN != NaN as values; as bits both are plain changes and are copied exactly
    prev = PreviousWeights()
    old = [("w", torch.tensor([0.0, 1.0, float("nan"), 2.0]))]
    new = [("w", torch.tensor([-0.0, 1.0, float("nan"), 2.0]))]
    new[0][1].view(torch.int32)[2] = 0x7FC00001  # another NaN payload
    list(prev.record(iter(old), 1))
    held = _held(old)
    apply_delta(held, prev.encode(iter(new), 2))
    assert prev.last_stats["changed_elements"] == 2
    assert torch.equal(bits(held[0][1]), bits(new[0][1]))


def test_tied_lm_head_travels_as_a_reference_and_untied_does_not():
    for tied, expected in ((True, 1), (False, 0)):
        prev = PreviousWeights()
        weights = _model(0, torch.bfloat16, tied=tied)
        list(prev.record(iter(weights), 1))
        held = _held(weights)
        new = _step(weights, 0.5, seed=2)
        apply_delta(held, prev.encode(iter(new), 2))
        assert prev.last_stats["kinds"]["alias"] == expected and _same_bits(held, new)


def test_choose_kind_takes_the_smallest_exact_form():
    # bf16, n = 1024: indices 6k bytes, bitmask 128 + 2k, dense 2048
    assert choose_kind(1024, 0, 2) == UNCHANGED
    assert choose_kind(1024, 10, 2) == INDICES  # 40 + 24 (padded) < 128 + 24
    assert choose_kind(1024, 100, 2) == BITMASK  # 400 + 200 > 128 + 200
    assert choose_kind(1024, 1000, 2) == DENSE  # 128 + 2000 > 2048
    assert section_bytes(INDICES, 1024, 10, 2) == 40 + 24 and section_bytes(BITMASK, 1024, 100, 2) == 128 + 200
    assert ALIAS not in (choose_kind(8, k, 4) for k in range(9))


def test_pack_bits_round_trips_any_length():
    for n in (1, 7, 8, 9, 1000):
        mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
        packed = pack_bits(mask)
        assert packed.numel() == -(-n // 8) and torch.equal(unpack_bits(packed, n), mask)
    # element i sits at bit i % 8 of byte i // 8
    assert pack_bits(torch.tensor([True, False, True] + [False] * 6 + [True])).tolist() == [5, 2]


def test_sparse_bf16_change_is_at_least_ten_times_smaller():
    # 1% of bf16 elements changed: indices cost 6 bytes per change, 0.06 bytes per element against 2 dense
    prev = PreviousWeights()
    weights = [("w", torch.randn(256, 256).to(torch.bfloat16))]
    list(prev.record(iter(weights), 1))
    payload = prev.encode(iter(_step(weights, 0.01, seed=3)), 2)
    assert payload.numel() * 10 < 256 * 256 * 2
    assert prev.last_stats["kinds"]["indices"] == 1


def test_a_changed_model_refuses_a_delta_and_the_next_publish_must_be_full():
    prev = PreviousWeights()
    list(prev.record(iter(_model(0, torch.float32)), 1))
    with pytest.raises(ValueError, match="must go in full"):
        prev.encode(iter([("embed", torch.zeros(3))]), 2)
    assert prev.version is None
    with pytest.raises(RuntimeError, match="publish a full version first"):
        prev.encode(iter(_model(0, torch.float32)), 3)


def test_a_payload_for_another_model_is_refused():
    prev = PreviousWeights()
    weights = _model(0, torch.float32)
    list(prev.record(iter(weights), 1))
    payload = prev.encode(iter(_step(weights, 0.1, seed=1)), 2)
    with pytest.raises(RuntimeError, match="covers 4 tensors, the engine holds 3"):
        apply_delta(_held(weights)[:3], payload)
