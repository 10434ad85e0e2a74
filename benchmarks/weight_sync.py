"""Weight sync per version: `object_store` against `collective`, with 1 and 3 rollout workers, in one run.

    python benchmarks/weight_sync.py                       # Qwen2.5-0.5B shape, bf16, CPU, Ray
    python benchmarks/weight_sync.py --host-copy 1.5b      # GPU: only the learner's host copy (no Ray/vLLM)
    python benchmarks/weight_sync.py --delta               # dense against delta after real AdamW steps
    python benchmarks/weight_sync.py --delta --quick       # the same on a small shape (a minute)

Weights are the Qwen2.5-0.5B tensors (random, built directly as tensors in bf16 to halve the memory of the
four or so model copies the run holds; tied embeddings, so lm_head travels too: 1.26 GB a version). A sender
actor plays learner rank 0 with the real sender code (`HostBuffers` + one `ray.put`, or `CollectiveSender` over
gloo); each receiver actor uses the real receiver (`ObjectStoreReceiver`, `CollectiveReceiver`). A version
counts as delivered when every worker holds the new tensors in its own process, ready for the engine's
in-place load. The load into vLLM itself is left out: it is the same call for both backends (measured
separately by the exact-sync tests). Each version is timed end to end on the driver; the table gives the median.

`--delta` (weight_sync.delta) trains the Qwen2 model of the shape (random init, fp32 master weights, bf16 copies
published, as DeepSpeed's bf16 mode does) with real AdamW steps at each learning rate, then replays those versions
through the real senders and receivers, dense and delta, object_store and collective, on a three-raylet Ray
cluster on this machine (ray.cluster_utils.Cluster): the learner on node 0 and one worker on each node, so two of
the three workers read across nodes. Reported per version: the fraction of elements changed, the bytes sent,
the bytes that leave the learner's node, and the seconds until every worker holds the version.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = {  # Qwen2.5: hidden, layers, heads, kv heads, intermediate (benchmarks/_gpu_common.py SHAPES)
    "0.5b": (896, 24, 14, 2, 4864),
    "1.5b": (1536, 28, 12, 2, 8960),
    "tiny": (128, 2, 2, 1, 256),
}
VOCAB = 151936


def qwen2_tensors(shape: str, dtype: torch.dtype, device: str = "cpu", layers: int | None = None):
    """(name, tensor) in HF checkpoint names and order, tied lm_head listed too (as the learner sends it)."""
    hidden, num_layers, heads, kv_heads, inter = SHAPES[shape]
    num_layers = layers or num_layers
    kv = hidden // heads * kv_heads
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    embed = rand(VOCAB, hidden)
    out = [("model.embed_tokens.weight", embed)]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", rand(hidden, hidden)), (p + "self_attn.q_proj.bias", rand(hidden)),
                (p + "self_attn.k_proj.weight", rand(kv, hidden)), (p + "self_attn.k_proj.bias", rand(kv)),
                (p + "self_attn.v_proj.weight", rand(kv, hidden)), (p + "self_attn.v_proj.bias", rand(kv)),
                (p + "self_attn.o_proj.weight", rand(hidden, hidden)),
                (p + "mlp.gate_proj.weight", rand(inter, hidden)), (p + "mlp.up_proj.weight", rand(inter, hidden)),
                (p + "mlp.down_proj.weight", rand(hidden, inter)),
                (p + "input_layernorm.weight", rand(hidden)), (p + "post_attention_layernorm.weight", rand(hidden))]
    out += [("model.norm.weight", rand(hidden)), ("lm_head.weight", embed)]
    return out


def _group_info(host: str, port: int, world: int, metas: list, bucket_bytes: int) -> dict:
    """The join info of weights/collective.py's group_info, on gloo with a 300 s limit."""
    return {"host": host, "port": port, "world_size": world, "backend": "gloo", "timeout_s": 300.0,
            "bucket_bytes": bucket_bytes, "metas": metas}


class Sender:
    """Learner rank 0's side: the parameters and one sender per backend."""

    def __init__(self, shape: str, layers: int | None) -> None:
        torch.set_num_threads(1)
        self.weights = qwen2_tensors(shape, torch.bfloat16, layers=layers)
        self.collective = None

    def metas(self) -> list:
        from protocols.weight_wire import metas_of

        return [(m.name, m.dtype, list(m.shape)) for m in metas_of(self.weights)]

    def address(self) -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", s.getsockname()[1]

    def join(self, host: str, port: int, world: int, bucket_bytes: int) -> None:
        from weights.collective import CollectiveSender

        self.collective = CollectiveSender(None, on_gpu=False)
        self.collective.join(_group_info(host, port, world, self.metas(), bucket_bytes), torch.device("cpu"))

    def publish_object_store(self) -> list:
        import ray

        from weights.object_store import host_arrays

        # As LearnerRank.publish_weights on CPU under ZeRO-2: the parameters are put as they are.
        return [ray.put(host_arrays(iter(self.weights), None))]

    def publish_collective(self, version: int) -> list:
        self.collective.publish(iter(self.weights), version)
        return []

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.weights)


class Receiver:
    """A rollout worker's side, without the engine: the real receiver classes."""

    def __init__(self) -> None:
        from weights.object_store import ObjectStoreReceiver

        torch.set_num_threads(1)
        self.receiver = ObjectStoreReceiver(None)

    def join(self, host: str, port: int, rank: int, world: int, metas: list, bucket_bytes: int) -> None:
        from weights.collective import CollectiveReceiver

        self.receiver.close()
        self.receiver = CollectiveReceiver(None)
        self.receiver.join({**_group_info(host, port, world, metas, bucket_bytes), "rank": rank})

    def take(self, version: int, refs: list) -> int:
        def apply(weights: list) -> None:
            assert len(weights) > 0

        from protocols.weight_announcement import WeightAnnouncement

        return self.receiver.load(WeightAnnouncement(version=version, refs=refs), apply)

    def leave(self) -> None:
        self.receiver.close()
        from weights.object_store import ObjectStoreReceiver

        self.receiver = ObjectStoreReceiver(None)


def run_ray(args) -> None:
    import ray

    ray.init(num_cpus=8, include_dashboard=False, logging_level="ERROR")
    try:
        sender = ray.remote(Sender).options(num_cpus=0).remote(args.shape, args.layers)
        gb = ray.get(sender.num_bytes.remote()) / 1e9
        metas = ray.get(sender.metas.remote())
        bucket_bytes = args.bucket_mb * 2**20
        rows = []
        for round_ in range(args.rounds):  # the first rounds warm up the object store and page in memory
            rows = []
            for workers in (1, 3):
                receivers = [ray.remote(Receiver).options(num_cpus=0).remote() for _ in range(workers)]
                ray.get([r.leave.remote() for r in receivers])
                for transport in ("object_store", "collective"):
                    if transport == "collective":
                        host, port = ray.get(sender.address.remote())
                        refs = [sender.join.remote(host, port, workers + 1, bucket_bytes)]
                        refs += [r.join.remote(host, port, i + 1, workers + 1, metas, bucket_bytes)
                                 for i, r in enumerate(receivers)]
                        ray.get(refs)
                    times = []
                    for version in range(1, args.versions + 1):
                        start = time.perf_counter()
                        if transport == "object_store":
                            refs = ray.get(sender.publish_object_store.remote())
                        else:
                            refs = ray.get(sender.publish_collective.remote(version))
                        got = ray.get([r.take.remote(version, refs) for r in receivers])
                        times.append(time.perf_counter() - start)
                        assert got == [version] * workers
                        del refs
                    first, median = times[0], statistics.median(times[1:] or times)
                    rows.append((transport, workers, first, median, gb / median))
                    print(f"round {round_ + 1}: {transport:13s} workers={workers} first={first:6.2f}s "
                          f"median={median:6.2f}s {gb / median:5.2f} GB/s", flush=True)
                for r in receivers:
                    ray.kill(r)
        print(f"\nweights: Qwen2.5-{args.shape} shape{f' ({args.layers} layers)' if args.layers else ''}, bf16, "
              f"{gb:.2f} GB a version (tied lm_head sent too); bucket {args.bucket_mb} MiB; "
              f"median of versions 2..{args.versions} of round {args.rounds}\n")
        print("| transport | workers | s / version (median) | GB/s | first version s |")
        print("| --- | --- | --- | --- | --- |")
        for transport, workers, first, median, rate in rows:
            print(f"| {transport} | {workers} | {median:.2f} | {rate:.2f} | {first:.2f} |")
        by = {(t, w): m for t, w, _, m, _ in rows}
        for transport in ("object_store", "collective"):
            print(f"{transport}: 3 workers / 1 worker = {by[(transport, 3)] / by[(transport, 1)]:.2f}x")
        print(f"collective / object_store at 1 worker = {by[('collective', 1)] / by[('object_store', 1)]:.2f}x")
    finally:
        ray.shutdown()


# --- delta against dense after real AdamW steps ------------------------------------------------------------------
def adamw_versions(shape: str, layers: int | None, lr: float, steps: int, seed: int = 0) -> tuple[list, list, list]:
    """(version 0 in bf16, the delta payloads of versions 1..steps, their stats) of the Qwen2 model of `shape`
    (random init, tied embeddings) trained by AdamW at `lr` on random tokens: fp32 master weights, bf16 copies
    published, as a DeepSpeed bf16 learner publishes them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from weights.delta import PreviousWeights

    hidden, num_layers, heads, kv_heads, inter = SHAPES[shape]
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers or num_layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, tie_word_embeddings=True, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(seed)

    def bf16_version() -> list:
        # tied lm_head: one bf16 tensor under both names, as the learner's tied parameter is
        copies: dict[int, torch.Tensor] = {}
        return [(name, copies.setdefault(id(p), p.detach().to(torch.bfloat16)))
                for name, p in model.named_parameters(remove_duplicate=False)]

    base = bf16_version()
    previous = PreviousWeights()
    list(previous.record(iter(base), 0))
    payloads, stats = [], []
    for step in range(1, steps + 1):
        ids = torch.randint(0, VOCAB, (1, 32), generator=g)  # one short sequence: the 0.5B step is slow on CPU
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        payloads.append(previous.encode(iter(bf16_version()), step))
        stats.append({**previous.last_stats, "encode_s": time.perf_counter() - t0, "train_s": train_s})
        print(f"lr {lr:g} step {step}: {stats[-1]['changed_elements'] / stats[-1]['elements']:.4%} of elements "
              f"changed, delta {payloads[-1].numel() / 1e6:.1f} MB, kinds {stats[-1]['kinds']}, "
              f"train {train_s:.1f}s", flush=True)
    del model, optimizer
    return base, payloads, stats


class DeltaSender:
    """Learner rank 0 on node 0: trains the versions (adamw_versions), then replays them (version 0 + the
    payloads) through one real sender at a time."""

    def __init__(self, shape: str, layers: int | None, lr: float, steps: int) -> None:
        self.base, self.payloads, self.stats = adamw_versions(shape, layers, lr, steps)
        torch.set_num_threads(1)
        self.sender = None

    def train_stats(self) -> tuple[list, int]:
        return self.stats, sum(t.numel() * t.element_size() for _, t in self.base)

    def start(self, transport: str, delta: bool, host: str = "", port: int = 0, world: int = 0,
              bucket_bytes: int = 0) -> None:
        from weights.backends import weight_backend
        from protocols.config import load_config

        cfg = load_config(None, [f"weight_sync.type={transport}", f"weight_sync.delta={str(delta).lower()}",
                                 f"weight_sync.bucket_mb={bucket_bytes // 2**20 or 256}"])
        # the live weights restart at version 0 (tied lm_head: one tensor under both names)
        copies: dict[int, torch.Tensor] = {}
        self.live = [(name, copies.setdefault(id(t), t.clone())) for name, t in self.base]
        self.sender = weight_backend(cfg).sender(cfg, on_gpu=False)
        if transport == "collective":
            self.sender.join(_group_info(host, port, world, self.metas(), bucket_bytes), torch.device("cpu"))

    def metas(self) -> list:
        from protocols.weight_wire import metas_of

        return [(m.name, m.dtype, list(m.shape)) for m in metas_of(self.base)]

    def address(self) -> tuple[str, int]:
        return Sender.address(self)

    def publish(self, version: int) -> dict:
        from weights.delta import apply_delta

        start = time.perf_counter()
        if version > 1:  # version 1 is the base; later ones are the trained steps (the learner's step: not timed)
            apply_delta(self.live, self.payloads[version - 2])
        replay_s = time.perf_counter() - start
        published = self.sender.publish(iter(self.live), version)
        return {"refs": published.refs, "num_bytes": published.num_bytes, "seconds": published.seconds,
                "replay_s": replay_s}


class DeltaReceiver:
    """A rollout worker without the engine: the real receiver, its held copy updated to each version."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.receiver = None

    def start(self, transport: str, delta: bool, info: dict | None = None) -> None:
        from weights.backends import weight_backend
        from protocols.config import load_config

        if self.receiver is not None:
            self.receiver.close()
        cfg = load_config(None, [f"weight_sync.type={transport}", f"weight_sync.delta={str(delta).lower()}"])
        self.receiver = weight_backend(cfg).receiver(cfg)
        if info is not None:
            self.receiver.join(info)

    def take(self, version: int, refs: list) -> tuple[int, int]:
        """(version held, bytes this worker has read from the object store so far)."""
        from protocols.weight_announcement import WeightAnnouncement

        got = self.receiver.load(WeightAnnouncement(version=version, refs=refs), lambda weights: None)
        return got, getattr(self.receiver, "read_bytes", 0)


def run_delta(args) -> None:
    import ray
    from ray.cluster_utils import Cluster

    lrs = [float(x) for x in args.lrs.split(",")]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"node0": 4},
                                                            "object_store_memory": args.store_gib * 2**30})
    for i in (1, 2):
        cluster.add_node(num_cpus=4, resources={f"node{i}": 4}, object_store_memory=args.store_gib * 2**30)
    ray.init(address=cluster.address, include_dashboard=False, logging_level="ERROR")
    rows = []
    try:
        bucket_bytes = args.bucket_mb * 2**20
        for lr in lrs:
            sender = ray.remote(DeltaSender).options(num_cpus=0, resources={"node0": 1}).remote(
                args.shape, args.layers, lr, args.steps)
            stats, dense_bytes = ray.get(sender.train_stats.remote())
            receivers = [ray.remote(DeltaReceiver).options(num_cpus=0, resources={f"node{i}": 1}).remote()
                         for i in range(3)]
            for transport in ("object_store", "collective"):
                for delta in (False, True):
                    if transport == "collective":
                        host, port = ray.get(sender.address.remote())
                        metas = ray.get(sender.metas.remote())
                        info = _group_info(host, port, 4, metas, bucket_bytes)
                        refs = [sender.start.remote(transport, delta, host, port, 4, bucket_bytes)]
                        refs += [r.start.remote(transport, delta, {**info, "rank": i + 1})
                                 for i, r in enumerate(receivers)]
                    else:
                        refs = [sender.start.remote(transport, delta)]
                        refs += [r.start.remote(transport, delta) for r in receivers]
                    ray.get(refs)
                    times, sent, crossed, read_before = [], [], [], [0, 0, 0]
                    for version in range(1, len(stats) + 2):
                        start = time.perf_counter()
                        published = ray.get(sender.publish.remote(version))
                        got = ray.get([r.take.remote(version, published["refs"]) for r in receivers])
                        seconds = time.perf_counter() - start - published["replay_s"]
                        assert [v for v, _ in got] == [version] * 3
                        read = [b for _, b in got]
                        if transport == "object_store":  # nodes 1 and 2 pull what their worker reads
                            cross = sum(read[i] - read_before[i] for i in (1, 2))
                        else:  # the broadcast reaches the receivers on nodes 1 and 2 over the network
                            cross = 2 * published["num_bytes"]
                        read_before = read
                        if version > 1:  # version 1 is the first (full) one; the table is about later versions
                            times.append(seconds)
                            sent.append(published["num_bytes"])
                            crossed.append(cross)
                    changed = statistics.mean(s["changed_elements"] / s["elements"] for s in stats)
                    row = {"lr": lr, "transport": transport, "mode": "delta" if delta else "dense",
                           "changed": changed, "sent": statistics.mean(sent), "crossed": statistics.mean(crossed),
                           "seconds": statistics.median(times), "dense_bytes": dense_bytes}
                    rows.append(row)
                    print(f"lr {lr:g} {transport:12s} {row['mode']:5s}: {row['sent'] / 1e6:8.1f} MB sent, "
                          f"{row['crossed'] / 1e6:8.1f} MB across nodes, {row['seconds']:.2f} s / version",
                          flush=True)
            for actor in (sender, *receivers):
                ray.kill(actor)
    finally:
        ray.shutdown()
        cluster.shutdown()
    layers = f", {args.layers} layers" if args.layers else ""
    print(f"\nQwen2.5-{args.shape} shape{layers}, bf16 (tied lm_head sent too: "
          f"{rows[0]['dense_bytes'] / 1e9:.2f} GB dense), AdamW steps 1..{args.steps} per learning rate, "
          "3 workers on 3 raylets (learner on node 0); mean bytes and median seconds over the trained versions\n")
    print("| lr | changed elements | transport | mode | MB / version | MB across nodes | s / version | "
          "bytes dense / delta |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    by = {(r["lr"], r["transport"], r["mode"]): r for r in rows}
    for r in rows:
        ratio = by[(r["lr"], r["transport"], "dense")]["sent"] / r["sent"]
        print(f"| {r['lr']:g} | {r['changed']:.2%} | {r['transport']} | {r['mode']} | {r['sent'] / 1e6:.1f} | "
              f"{r['crossed'] / 1e6:.1f} | {r['seconds']:.2f} | {ratio:.1f}x |")


def run_host_copy(shape: str, repeats: int) -> None:
    """The object-store sender's host copy on a GPU: reusable page-locked buffers (goal <= 0.1 s for 1.5b)."""
    from weights.object_store import HostBuffers, host_copy_seconds

    device = "cuda" if torch.cuda.is_available() else "cpu"
    weights = qwen2_tensors(shape, torch.bfloat16, device=device)
    gb = sum(t.numel() * t.element_size() for _, t in weights) / 1e9
    buffers = HostBuffers()
    first = host_copy_seconds(iter(weights), buffers)
    reused = [host_copy_seconds(iter(weights), buffers) for _ in range(repeats)]
    fresh_start = time.perf_counter()
    _ = {n: (t.cpu() if t.is_cuda else t.clone()) for n, t in weights}  # .cpu() on CPU would not copy
    if device == "cuda":
        torch.cuda.synchronize()
    fresh = time.perf_counter() - fresh_start
    best = min(reused)
    print(f"{shape} on {device}: {gb:.2f} GB; pinned={buffers.pin_memory}; first (allocates) {first:.3f}s; "
          f"reused buffers best {best:.3f}s ({gb / best:.1f} GB/s), median {statistics.median(reused):.3f}s; "
          f"fresh .cpu() copies {fresh:.3f}s; fresh/reused = {fresh / best:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2, help="the table shows the last round")
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--host-copy", default=None, choices=sorted(SHAPES),
                        help="only time the learner's host copy of this shape (GPU), no Ray")
    parser.add_argument("--delta", action="store_true", help="dense against delta after real AdamW steps")
    parser.add_argument("--quick", action="store_true", help="with --delta: the tiny shape, 2 steps")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="with --delta: learning rates, comma-separated")
    parser.add_argument("--steps", type=int, default=2, help="with --delta: AdamW steps (versions) per rate")
    parser.add_argument("--store-gib", type=float, default=4.0, help="with --delta: object store per raylet")
    args = parser.parse_args()
    if args.delta:
        if args.quick:
            args.shape, args.steps = "tiny", 2
        run_delta(args)
    elif args.host_copy:
        run_host_copy(args.host_copy, repeats=5)
    else:
        run_ray(args)


if __name__ == "__main__":
    main()
