"""Weight transport without Ray or vLLM: the bucket layout, reusable host buffers, and the collective backend
over a real gloo group (sender and receiver threads in one process), including its failure messages."""

import socket
import threading
import time

import pytest
import torch

from actors.weight_receiver import CollectiveReceiver
from learner.weight_transport import CollectiveSender, HostBuffers, host_arrays, host_copy_seconds
from learner.weight_wire import BucketLayout, WeightMeta, metas_of, open_weight_group, unpack_state_dict


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


def _connect(port: int, world: int, layout_bytes: int, metas, timeout_s: float = 30.0):
    """Open the group with a sender (rank 0) and world-1 receivers, each receiver in its own thread."""
    receivers: list = [None] * (world - 1)

    def join(rank):
        receivers[rank - 1] = CollectiveReceiver("127.0.0.1", port, rank, world, "gloo", timeout_s, metas,
                                                 layout_bytes, torch.device("cpu"))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    group, store = open_weight_group("127.0.0.1", port, 0, world, "gloo", timeout_s)
    for t in threads:
        t.join()
    sender = CollectiveSender(group, store, BucketLayout(metas, layout_bytes), torch.device("cpu"), timeout_s)
    return sender, receivers


@pytest.mark.parametrize("num_receivers", [1, 3])
def test_collective_broadcast_delivers_each_version_exactly(num_receivers):
    metas = metas_of(_weights(0))
    # 300 bytes: embed (512 B) and lm_head get buckets of their own, the small ones share: several buckets
    sender, receivers = _connect(_free_port(), 1 + num_receivers, 300, metas)
    try:
        for version in (1, 2):
            weights = _weights(version)
            stats = sender.send(iter(weights), version)
            assert stats["num_bytes"] == 512 + 128 + 32 + 512
            for receiver in receivers:
                got_version, got = receiver.fetch(version, [])
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
        sender.send(iter(_weights(1)), 1)
        sender.send(iter(_weights(2)), 2)  # the loop never loaded version 1
        version, got = receiver.fetch(1, [])
        try:
            assert version == 2 and torch.equal(got[0][1], _weights(2)[0][1])
        finally:
            receiver.release()
    finally:
        receiver.close()


def test_join_without_learner_fails_in_time_naming_the_settings():
    start = time.perf_counter()
    with pytest.raises(RuntimeError) as err:
        CollectiveReceiver("127.0.0.1", _free_port(), 1, 2, "gloo", 2.0, metas_of(_weights(0)), 1 << 20,
                           torch.device("cpu"))
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
    thread = threading.Thread(target=lambda: holder.setdefault(
        "r", CollectiveReceiver("127.0.0.1", port, 1, 2, "gloo", 5.0, metas, 1 << 20, torch.device("cpu"))))
    thread.start()
    group, store = open_weight_group("127.0.0.1", port, 0, 2, "gloo", 5.0)
    thread.join()
    receiver = holder["r"]
    sender = CollectiveSender(group, store, BucketLayout(other, 1 << 20), torch.device("cpu"), 5.0)
    outcome = {}

    def send():
        try:
            sender.send(iter(_weights(0)[:3]), 1)  # announces its own layout, which the receiver refuses
        except RuntimeError as err:  # the receiver never joins the buckets: the broadcast times out
            outcome["sender"] = str(err)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="layout") as err:
            receiver.fetch(1, [])
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

    from learner.weight_transport import BroadcastFailed

    port = _free_port()
    code = ("import time; from learner.weight_wire import open_weight_group; "
            f"open_weight_group('127.0.0.1', {port}, 1, 2, 'gloo', 30.0); time.sleep(600)")
    repo = str(Path(__file__).resolve().parents[1])
    child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": repo})
    try:
        group, store = open_weight_group("127.0.0.1", port, 0, 2, "gloo", 30.0)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    time.sleep(0.5)  # gloo's event loop reads the closed connection
    metas = metas_of(_weights(0))
    sender = CollectiveSender(group, store, BucketLayout(metas, 300), torch.device("cpu"), 30.0)
    yielded = []

    def weights():
        for pair in _weights(1):
            yielded.append(pair[0])
            yield pair

    start = time.perf_counter()
    with pytest.raises(BroadcastFailed, match="weight_sync.type=collective: broadcast of the .* failed"):
        sender.send(weights(), 1)
    assert time.perf_counter() - start < 10  # the closed connection is seen, not waited out to the timeout
    assert yielded == [name for name, _ in _weights(1)]
