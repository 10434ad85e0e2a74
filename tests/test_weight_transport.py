"""Weight transport without Ray or vLLM: the backend registry, the bucket layout, reusable host buffers, and the
collective backend over a real gloo group (sender and receiver threads in one process), including its failure
messages."""

import socket
import threading
import time

import pytest
import torch

from protocols.config import load_config
from protocols.weight_announcement import WeightAnnouncement
from protocols.weight_wire import BucketLayout, WeightMeta, metas_of
from weights.collective import CollectiveReceiver, CollectiveSender, group_info, open_weight_group
from weights.object_store import HostBuffers, host_arrays, host_copy_seconds, unpack_state_dict

CFG = load_config(None, ["weight_sync.type=collective"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(seed: int, tied: bool = True) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(16, 8, generator=g)
    out = [("model.embed_tokens.weight", embed),
           ("model.layers.0.mlp.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
           ("model.norm.weight", torch.randn(8, generator=g))]
    out.append(("lm_head.weight", embed if tied else torch.randn(16, 8, generator=g)))
    return out


def test_bucket_layout_packs_in_order_and_aligns():
    metas = [WeightMeta("a", "float32", (10,)), WeightMeta("b", "float32", (20,)),
             WeightMeta("c", "bfloat16", (100,)), WeightMeta("d", "float32", (3,))]
    layout = BucketLayout(metas, bucket_bytes=128)
    # a: 40 B at 0 (next offset rounds up to 64); b: 80 B would end at 144 > 128 -> new bucket at 0 (ends 80,
    # rounds to 128); c: 200 B > bucket, its own bucket; d: 12 B starts a new bucket because c filled the last.
    assert layout.buckets == [[(0, 0)], [(1, 0)], [(2, 0)], [(3, 0)]]
    assert layout.bucket_sizes == [64, 128, 256, 64]
    assert layout.num_bytes == 40 + 80 + 200 + 12
    small = BucketLayout(metas[:2] + metas[3:], bucket_bytes=1024)
    assert small.buckets == [[(0, 0), (1, 64), (2, 192)]]  # 40->64, 80->128: offsets 0, 64, 192
    assert small.checksum != layout.checksum


def test_host_buffers_are_reused_and_exact():
    buffers = HostBuffers(pin_memory=False)
    first = _weights(0)
    packed = buffers.pack(iter(first))
    assert buffers.allocations == 4  # tied lm_head still gets its own buffer: both names are sent
    pointers = {name: array.ctypes.data for name, (_, array) in packed.items()}
    second = _weights(1)
    packed = buffers.pack(iter(second))
    assert buffers.allocations == 4
    assert {name: array.ctypes.data for name, (_, array) in packed.items()} == pointers
    for (name, expected), (got_name, got) in zip(second, unpack_state_dict(packed)):
        assert name == got_name and got.dtype == expected.dtype and torch.equal(got, expected)
    assert host_copy_seconds(iter(second), buffers) >= 0 and buffers.allocations == 4


def test_host_arrays_without_buffers_are_views_of_the_weights():
    weights = _weights(0)
    packed = host_arrays(iter(weights), None)
    # no copy: ray.put is the one copy on a CPU learner
    assert packed["model.norm.weight"][1].ctypes.data == weights[2][1].data_ptr()
    assert packed["model.layers.0.mlp.weight"][0] == "bfloat16"  # travels as int16 bits, restored on unpack
    assert torch.equal(dict(unpack_state_dict(packed))["model.layers.0.mlp.weight"], weights[1][1])


def _info(port: int, world: int, bucket_bytes: int, metas, timeout_s: float, rank: int = 0) -> dict:
    """What LearnerGroup.join_weight_group hands each member (group_info, plus the member's rank)."""
    rows = [(m.name, m.dtype, list(m.shape)) for m in metas]
    return {**group_info(CFG, "127.0.0.1", port, world, rows), "backend": "gloo", "timeout_s": timeout_s,
            "bucket_bytes": bucket_bytes, "rank": rank}


def _receiver(info: dict) -> CollectiveReceiver:
    receiver = CollectiveReceiver(CFG)
    receiver.join(info)
    return receiver


def _connect(port: int, world: int, layout_bytes: int, metas, timeout_s: float = 30.0):
    """Open the group with a sender (rank 0) and world-1 receivers, each receiver in its own thread."""
    receivers: list = [None] * (world - 1)

    def join(rank):
        receivers[rank - 1] = _receiver(_info(port, world, layout_bytes, metas, timeout_s, rank))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    sender = CollectiveSender(CFG, on_gpu=False)
    sender.join(_info(port, world, layout_bytes, metas, timeout_s), torch.device("cpu"))
    for t in threads:
        t.join()
    return sender, receivers


@pytest.mark.parametrize("num_receivers", [1, 3])
def test_collective_broadcast_delivers_each_version_exactly(num_receivers):
    metas = metas_of(_weights(0))
    # 300 bytes: embed (512 B) and lm_head get buckets of their own, the small ones share: several buckets
    sender, receivers = _connect(_free_port(), 1 + num_receivers, 300, metas)
    try:
        for version in (1, 2):
            weights = _weights(version)
            announcement = sender.publish(iter(weights), version)
            assert announcement.version == version and announcement.refs == []
            assert announcement.num_bytes == 512 + 128 + 32 + 512 and announcement.seconds >= 0
            for receiver in receivers:
                got_version, got = receiver.stage(announcement)
                try:
                    assert got_version == version
                    for (name, expected), (got_name, tensor) in zip(weights, got):
                        assert name == got_name and tensor.dtype == expected.dtype and torch.equal(tensor, expected)
                finally:
                    receiver.release()
    finally:
        for receiver in receivers:
            receiver.close()


def test_collective_receiver_keeps_the_newest_unloaded_version():
    metas = metas_of(_weights(0))
    sender, (receiver,) = _connect(_free_port(), 2, 1 << 20, metas)
    try:
        sender.publish(iter(_weights(1)), 1)
        sender.publish(iter(_weights(2)), 2)  # the loop never loaded version 1
        applied = []
        version = receiver.load(WeightAnnouncement(version=1), lambda pairs: applied.append(pairs[0][1].clone()))
        assert version == 2 and torch.equal(applied[0], _weights(2)[0][1])
        # load released the staging lock: the receiver thread can stage the next version
        sender.publish(iter(_weights(3)), 3)
        assert receiver.load(WeightAnnouncement(version=3), lambda pairs: None) == 3
    finally:
        receiver.close()


def test_join_without_learner_fails_in_time_naming_the_settings():
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as err:
        _receiver(_info(_free_port(), 2, 1 << 20, metas_of(_weights(0)), 2.0, rank=1))
    assert time.perf_counter() - start < 30
    text = str(err.value)
    assert "weight_sync.type=collective" in text and "weight_sync.timeout_s=2.0" in text
    assert "weight_sync.type=object_store" in text


def test_port_in_use_names_the_settings():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="weight_sync.type=object_store"):
            open_weight_group("127.0.0.1", port, 0, 2, "gloo", 2.0)


def test_layout_mismatch_is_reported_by_the_receiver():
    metas = metas_of(_weights(0))
    other = metas_of(_weights(0)[:3])  # the learner's model lost a tensor after the join
    port = _free_port()
    holder = {}
    thread = threading.Thread(target=lambda: holder.setdefault("r", _receiver(_info(port, 2, 1 << 20, metas, 5.0, 1))))
    thread.start()
    sender = CollectiveSender(CFG, on_gpu=False)
    sender.join(_info(port, 2, 1 << 20, other, 5.0), torch.device("cpu"))
    thread.join()
    receiver = holder["r"]
    outcome = {}

    def send():
        try:
            sender.publish(iter(_weights(0)[:3]), 1)  # announces its own layout, which the receiver refuses
        except RuntimeError as err:  # the receiver never joins the buckets: the broadcast times out
            outcome["sender"] = str(err)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="layout") as err:
            receiver.stage(WeightAnnouncement(version=1))
        assert "object_store" in str(err.value)
    finally:
        receiver.close()
        thread.join()
    # gloo may buffer a small send, so the sender either finished or failed naming the settings
    assert "sender" not in outcome or "weight_sync.timeout_s=5.0" in outcome["sender"]


def test_broadcast_to_a_dead_engine_raises_broadcast_failed_and_drains_the_weights():
    """A rollout engine that died (here: a process killed after it joined) breaks the broadcast at once with
    BroadcastFailed, the error the supervisor answers by replacing it; the weight iterator is still run to its end,
    since under ZeRO-3 the other learner ranks wait in its gathers."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from weights.transport import BroadcastFailed

    port = _free_port()
    code = ("import time; from weights.collective import open_weight_group; "
            f"open_weight_group('127.0.0.1', {port}, 1, 2, 'gloo', 30.0); time.sleep(600)")
    repo = str(Path(__file__).resolve().parents[1])
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": repo})
    sender = CollectiveSender(CFG, on_gpu=False)
    try:
        sender.join(_info(port, 2, 300, metas_of(_weights(0)), 30.0), torch.device("cpu"))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    time.sleep(0.5)  # gloo's event loop reads the closed connection
    yielded = []

    def weights():
        for pair in _weights(1):
            yielded.append(pair[0])
            yield pair

    start = time.perf_counter()
    with pytest.raises(BroadcastFailed, match="weight_sync.type=collective: broadcast of the .* failed"):
        sender.publish(weights(), 1)
    assert time.perf_counter() - start < 10  # the closed connection is seen, not waited out to the timeout
    assert yielded == [name for name, _ in _weights(1)]


# --- the registry: one place chooses the backend ----------------------------------------------------------------
def _weight_sync_types() -> list[str]:
    from typing import get_args

    from protocols.config import WeightSyncConfig

    union = get_args(WeightSyncConfig)[0]  # Annotated[Union[...], Field(discriminator="type")]
    return [get_args(model.model_fields["type"].annotation)[0] for model in get_args(union)]


def test_every_weight_sync_type_has_a_sender_and_a_receiver():
    from weights.backends import BACKENDS, weight_backend
    from weights.transport import WeightReceiver, WeightSender

    types = _weight_sync_types()
    assert sorted(types) == ["collective", "object_store"]
    assert sorted(BACKENDS) == sorted(types)  # no backend without a config literal either
    for name in types:
        cfg = load_config(None, [f"weight_sync.type={name}"])
        backend = weight_backend(cfg)
        sender, receiver = backend.sender(cfg, on_gpu=False), backend.receiver(cfg)
        assert backend.type == name and isinstance(sender, WeightSender) and isinstance(receiver, WeightReceiver)
        assert sender.type == receiver.type == name
        # only a backend that forms a group can be joined; the others say so
        if not backend.forms_group:
            with pytest.raises(RuntimeError, match=f"weight_sync.type={name} forms no weight group"):
                receiver.join({})


def test_collective_group_info_resolves_auto_backend_and_bucket_bytes():
    # cluster.use_gpus=false: auto -> gloo; bucket_mb 2 -> 2 MiB
    cfg = load_config(None, ["weight_sync.type=collective", "weight_sync.bucket_mb=2"])
    info = group_info(cfg, "10.0.0.1", 1234, 3, [("w", "float32", [2])])
    assert info == {"host": "10.0.0.1", "port": 1234, "world_size": 3, "backend": "gloo", "timeout_s": 120.0,
                    "bucket_bytes": 2 * 2**20, "metas": [("w", "float32", [2])]}


def test_a_receiver_that_never_joined_names_the_join():
    with pytest.raises(RuntimeError, match="not joined the weight group"):
        CollectiveReceiver(CFG).stage(WeightAnnouncement(version=1))


def test_object_store_receiver_applies_what_the_sender_packed():
    # The object store without Ray: the packed arrays stand in for what ray.get returns.
    from weights import object_store

    cfg = load_config(None, [])
    weights = _weights(0)
    packed = object_store.host_arrays(iter(weights), object_store.HostBuffers(pin_memory=False))
    receiver = object_store.ObjectStoreReceiver(cfg)
    receiver.stage = lambda announcement: (announcement.version, object_store.unpack_state_dict(announcement.refs[0]))
    applied = {}
    assert receiver.load(WeightAnnouncement(version=4, refs=[packed]), applied.update) == 4
    assert applied.keys() == dict(weights).keys()
    for name, tensor in weights:
        assert applied[name].dtype == tensor.dtype and torch.equal(applied[name], tensor)
    with pytest.raises(RuntimeError, match="without an object ref"):
        object_store.ObjectStoreReceiver(cfg).stage(WeightAnnouncement(version=4))


def test_only_the_registry_reads_weight_sync_type():
    """Adding a backend must not mean new branches: no module but weights/backends.py compares the type."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"weight_sync\.type\s*[!=]=|\.type\s*[!=]=\s*[\"'](object_store|collective)[\"']")
    offenders = [f"{path.relative_to(root)}:{i}" for folder in ("actors", "cluster", "learner", "protocols", "weights")
                 for path in sorted((root / folder).glob("*.py"))
                 for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
