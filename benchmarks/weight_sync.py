"""Weight sync per version: `object_store` against `collective`, with 1 and 3 rollout workers, in one run.

    python benchmarks/weight_sync.py                       # Qwen2.5-0.5B shape, bf16, CPU, Ray
    python benchmarks/weight_sync.py --host-copy 1.5b      # GPU: only the learner's host copy (no Ray/vLLM)

Weights are the Qwen2.5-0.5B tensors (random, built directly as tensors in bf16 to halve the memory of the
four or so model copies the run holds; tied embeddings, so lm_head travels too: 1.26 GB a version). A sender
actor plays learner rank 0 with the real sender code (`HostBuffers` + one `ray.put`, or `CollectiveSender` over
gloo); each receiver actor uses the real receiver (`ObjectStoreReceiver`, `CollectiveReceiver`). A version
counts as delivered when every worker holds the new tensors in its own process, ready for the engine's
in-place load. The load into vLLM itself is left out: it is the same call for both backends (measured
separately by the exact-sync tests). Each version is timed end to end on the driver; the table gives the median.
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
    """The join info of learner/transport_collective.py's group_info, on gloo with a 300 s limit."""
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
        from learner.transport_collective import CollectiveSender

        self.collective = CollectiveSender(None, on_gpu=False)
        self.collective.join(_group_info(host, port, world, self.metas(), bucket_bytes), torch.device("cpu"))

    def publish_object_store(self) -> list:
        import ray

        from learner.transport_object_store import host_arrays

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
        from learner.transport_object_store import ObjectStoreReceiver

        torch.set_num_threads(1)
        self.receiver = ObjectStoreReceiver(None)

    def join(self, host: str, port: int, rank: int, world: int, metas: list, bucket_bytes: int) -> None:
        from learner.transport_collective import CollectiveReceiver

        self.receiver.close()
        self.receiver = CollectiveReceiver(None)
        self.receiver.join({**_group_info(host, port, world, metas, bucket_bytes), "rank": rank})

    def take(self, version: int, refs: list) -> int:
        def apply(weights: list) -> None:
            assert len(weights) > 0

        return self.receiver.load(version, refs, apply)

    def leave(self) -> None:
        self.receiver.close()
        from learner.transport_object_store import ObjectStoreReceiver

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


def run_host_copy(shape: str, repeats: int) -> None:
    """The object-store sender's host copy on a GPU: reusable page-locked buffers (goal <= 0.1 s for 1.5b)."""
    from learner.transport_object_store import HostBuffers, host_copy_seconds

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
    args = parser.parse_args()
    if args.host_copy:
        run_host_copy(args.host_copy, repeats=5)
    else:
        run_ray(args)


if __name__ == "__main__":
    main()
