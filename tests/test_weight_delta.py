"""Delta encoding of weight versions (weights/delta.py) without Ray or vLLM: exact round trips of raw bits
in fp32 and bf16, for sparse, dense, empty and aliased changes, and the size of each form."""

import pytest
import torch

from protocols.weight_announcement import DeltaStats, WeightAnnouncement
from weights.delta import (ALIAS, BITMASK, DENSE, GAPS, INDICES, UNCHANGED, PreviousWeights, apply_delta, bits,
                           choose_kind, gap_positions, pack_bits, section_bytes, unpack_bits)


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
    return all(na == nb and torch.equal(bits(ta.contiguous()), bits(tb.contiguous()))
               for (na, ta), (nb, tb) in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.01, 0.05, 0.3, 1.0])
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
    # 100 changes in 100 gap entries: 104 + 200 bytes, below bitmask's 128 + 200; 120 entries (120 + 240) are not
    assert choose_kind(1024, 100, 2, gap_entries=100) == GAPS
    assert choose_kind(1024, 100, 2, gap_entries=120) == BITMASK


def test_pack_bits_round_trips_any_length():
    for n in (1, 7, 8, 9, 1000):
        mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
        packed = pack_bits(mask)
        assert packed.numel() == -(-n // 8) and torch.equal(unpack_bits(packed, n), mask)
    # element i sits at bit i % 8 of byte i // 8
    assert pack_bits(torch.tensor([True, False, True] + [False] * 6 + [True])).tolist() == [5, 2]


def test_sparse_bf16_change_is_at_least_ten_times_smaller():
    # 1% of bf16 elements changed: gaps cost about 3 bytes per change (1 + 2, plus an entry per 255 unchanged in
    # a row), 0.03 bytes per element against 2 dense; int32 indices would cost 6
    prev = PreviousWeights()
    weights = [("w", torch.randn(256, 256).to(torch.bfloat16))]
    list(prev.record(iter(weights), 1))
    payload = prev.encode(iter(_step(weights, 0.01, seed=3)), 2)
    changed = prev.last_stats["changed_elements"]
    assert payload.numel() * 50 < 256 * 256 * 2 and payload.numel() < 6 * changed
    assert prev.last_stats["kinds"]["gaps"] == 1


def test_gap_positions_add_an_entry_every_255_unchanged():
    # changes at 0 and 600: gaps 1 and 600; 600 takes three entries (255, 255, 90) -> positions 0, 255, 510, 600
    assert gap_positions(torch.tensor([0, 600])).tolist() == [0, 255, 510, 600]
    assert gap_positions(torch.tensor([254, 255])).tolist() == [254, 255]


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


# --- through the transports (no Ray, no vLLM): object_store's chain, collective's broadcast over gloo ------------
class _FakeRay:
    """ray.put / ray.get in one process: what the object-store sender and receiver call."""

    def __init__(self) -> None:
        self.objects: list = []

    def put(self, value):
        import copy

        self.objects.append(copy.deepcopy(value))  # ray.put copies: the sender may reuse its buffers
        return len(self.objects) - 1

    def get(self, ref):
        return self.objects[ref]


def _object_store(monkeypatch, dtype=torch.bfloat16):
    import sys

    from weights.object_store import ObjectStoreReceiver, ObjectStoreSender
    from protocols.config import load_config

    monkeypatch.setitem(sys.modules, "ray", _FakeRay())
    cfg = load_config(None, ["weight_sync.delta=true"])
    return ObjectStoreSender(cfg, on_gpu=False), lambda: ObjectStoreReceiver(cfg)


def _loaded(receiver, announcement: WeightAnnouncement):
    got = {}
    loaded = receiver.load(announcement, lambda pairs: got.update((n, t.clone()) for n, t in pairs))
    assert loaded == announcement.version
    return list(got.items())


def test_object_store_chain_serves_current_behind_and_new_workers(monkeypatch):
    sender, new_receiver = _object_store(monkeypatch)
    current, behind = new_receiver(), new_receiver()
    weights = _model(0, torch.bfloat16)
    first = sender.publish(iter(weights), 1)
    assert first.delta.base_version is None and len(first.refs) == 1  # the keyframe alone
    assert _same_bits(_loaded(current, first), weights)
    assert _same_bits(_loaded(behind, first), weights)
    full_bytes = current.read_bytes
    for v in range(2, 5):
        weights = _step(weights, 0.02, seed=v)
        published = sender.publish(iter(weights), v)
        assert published.delta.base_version == v - 1 and published.num_bytes < full_bytes / 3
        before = current.read_bytes
        assert _same_bits(_loaded(current, published), weights)
        assert current.read_bytes - before == published.num_bytes  # one delta, not the full version
    # `behind` holds version 1, the chain's keyframe: it applies the three deltas, still not a full read
    assert _same_bits(_loaded(behind, published), weights)
    assert behind.read_bytes - full_bytes < full_bytes
    # a replaced worker holds nothing: keyframe, then every delta
    fresh = new_receiver()
    assert _same_bits(_loaded(fresh, published), weights) and fresh.read_bytes > full_bytes


def test_object_store_puts_a_new_keyframe_when_the_deltas_outgrow_it(monkeypatch):
    sender, new_receiver = _object_store(monkeypatch)
    weights = _model(0, torch.bfloat16)
    early = new_receiver()
    _loaded(early, sender.publish(iter(weights), 1))
    versions = {1: weights}
    for v in range(2, 12):  # 30% changed: each delta is about a third of the model, so a keyframe every ~3
        versions[v] = _step(versions[v - 1], 0.3, seed=v)
        published = sender.publish(iter(versions[v]), v)
        keyframe, *deltas = published.refs
        assert sum(d[-1] for d in deltas) <= 2 * keyframe[-1]  # the store holds at most about two model copies
    assert keyframe[2] > 1  # a later keyframe replaced the first
    # the worker still at version 1 is behind the new keyframe: it reads it (and the deltas after), ends exact
    before = early.read_bytes
    assert _same_bits(_loaded(early, published), versions[11])
    assert early.read_bytes - before >= keyframe[-1]


def test_object_store_sends_a_version_whose_every_element_moved_as_one_keyframe(monkeypatch):
    """Every element changed (an adapter under AdamW): the delta would be as large as the version, so the version
    goes whole as the new keyframe, once, not as a delta plus a keyframe (twice the bytes)."""
    sender, new_receiver = _object_store(monkeypatch)
    weights = _model(0, torch.float32, tied=False)  # an adapter ties nothing
    current = new_receiver()
    first = sender.publish(iter(weights), 1)
    _loaded(current, first)
    for v in range(2, 5):
        weights = _step(weights, 1.0, seed=v)
        published = sender.publish(iter(weights), v)
        [keyframe] = published.refs
        assert keyframe[2] == v and published.num_bytes == first.num_bytes == keyframe[-1]
        before = current.read_bytes
        assert _same_bits(_loaded(current, published), weights)
        assert current.read_bytes - before == first.num_bytes


def test_a_failed_delta_send_makes_the_next_publish_full(monkeypatch):
    sender, new_receiver = _object_store(monkeypatch)
    weights = _model(0, torch.bfloat16)
    sender.publish(iter(weights), 1)
    with pytest.raises(ValueError, match="must go in full"):
        sender.publish(iter(weights[:2]), 2)  # the model lost tensors: refused, and the copy is dropped
    published = sender.publish(iter(weights), 3)
    assert published.delta.base_version is None and len(published.refs) == 1
    receiver = new_receiver()
    assert _same_bits(_loaded(receiver, published), weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collective_deltas_over_gloo_equal_a_full_broadcast(dtype):
    from protocols.weight_wire import metas_of
    from tests.test_weight_transport import _connect, _free_port

    weights = _model(0, dtype)
    # 2 KiB buckets: the model (about 12 KiB) travels full in several buckets, a delta in several pieces
    delta_sender, receivers = _connect(_free_port(), 3, 2048, metas_of(weights))
    delta_sender.previous = PreviousWeights()  # what weight_sync.delta=true builds
    try:
        published = delta_sender.publish(iter(weights), 1)
        assert published.delta.base_version is None
        for v in range(2, 6):
            weights = _step(weights, 0.05, seed=v)
            published = delta_sender.publish(iter(weights), v)
            assert published.delta.base_version == v - 1
            assert published.num_bytes < delta_sender.layout.num_bytes
            if v == 3:
                continue  # the loops skip version 3: their threads still apply its delta
            for receiver in receivers:
                got = _loaded(receiver, published)
                assert _same_bits(got, weights), f"{dtype}: version {v} differs after deltas"
    finally:
        for receiver in receivers:
            receiver.close()


def test_delta_metrics_say_full_or_the_changed_fraction():
    from weights.delta import delta_metrics

    assert delta_metrics(WeightAnnouncement(version=1, num_bytes=10)) == {}  # dense
    full = WeightAnnouncement(version=1, delta=DeltaStats(base_version=None, payload_bytes=10))
    assert delta_metrics(full) == {"weights/delta_full": 1.0}
    # 25 of 1000 elements changed
    delta = DeltaStats(base_version=3, payload_bytes=200, changed_elements=25, elements=1000)
    assert delta_metrics(WeightAnnouncement(version=4, delta=delta)) == {
        "weights/delta_full": 0.0, "weights/changed_frac": 0.025}


def test_a_collective_delta_against_a_version_the_engine_lacks_is_named():
    from protocols.weight_wire import metas_of
    from tests.test_weight_transport import _connect, _free_port

    weights = _model(0, torch.float32)
    sender, (receiver,) = _connect(_free_port(), 2, 1 << 20, metas_of(weights))
    sender.previous = PreviousWeights()
    list(sender.previous.record(iter(weights), 5))  # as if version 5 had gone to another group
    try:
        sender.publish(iter(_step(weights, 0.1, seed=1)), 6)
        with pytest.raises(RuntimeError, match="changes to version 5, but this engine holds version 0"):
            receiver.stage(WeightAnnouncement(version=6))
    finally:
        receiver.close()
