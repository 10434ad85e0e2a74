"""Long chain-of-thought on one GPU: `LearnerRank.train_step` on one long sample per step, today's path against
the long-CoT path, same run, same data. A script, not a test; it needs CUDA (--allow-cpu: a tiny smoke run).

    python benchmarks/long_cot_gpu.py                                   # 1.5B shape, 8k/32k/64k/128k responses
    python benchmarks/long_cot_gpu.py --lengths 8192,32768 --new-grad-ckpt on,off
    python benchmarks/long_cot_gpu.py --allow-cpu --shape tiny --vocab 4096 --lengths 256,512   # smoke test
    python benchmarks/long_cot_gpu.py --lengths 32768 --paths new --set learner.fused_adamw=true --profile

Rows (DeepSpeed ZeRO-2, bf16, prompt 256 tokens, preset dapo, --samples per step, one by default):
  old   learner.logits_chunk_tokens=0 (full (T, V) logits), sample-count micro-batches of 1, gradient
        checkpointing on: the learner before issue 9.
  new   learner.logits_chunk_tokens (--chunk-tokens), learner.max_tokens_per_micro_batch =
        --per-micro-batch x (prompt + response), packing on, gradient checkpointing per --new-grad-ckpt (so "checkpointing only where
        memory needs it" can be read off the table: off where it fits, on beyond).
A row that runs out of memory prints OOM and the run goes on. Peak GiB is torch.cuda.max_memory_allocated over
the row's steps (warm-up included, so optimizer state is counted). TFLOP/s counts model FLOPs (6N per token
plus causal attention, no recomputation: benchmarks/_gpu_common.py train_flops) over prompt and response tokens;
MFU divides it by the GPU's dense bf16 peak. --profile times one more step under torch.profiler and prints where
the GPU's time went. Helpers come from benchmarks/_gpu_common.py.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._gpu_common import (  # noqa: E402
    bf16_peak_tflops, build_model_folder, free_memory, free_port, make_shard, sync, train_flops)


def profile_step(learner, shard, normalizer, top: int = 14) -> None:
    """One more train_step under torch.profiler: the ops that took the most GPU time (self time, so a parent op
    does not count its children), then the shares of the kinds of work that matter for long sequences."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        learner.train_step(shard, normalizer)
        sync()
    # The table lists each kernel twice, under the op that launched it and under its own name: keep the ops.
    events = [e for e in prof.key_averages()
              if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CPU]
    total = sum(e.self_device_time_total for e in events)
    if total == 0:
        print("  profile: no GPU time recorded (a CPU run)")
        return
    print(f"  profile: {total / 1e6:.3f} s of GPU time in one step (kernels counted under their ops); top ops:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"    {e.self_device_time_total / 1e3:9.1f} ms {100 * e.self_device_time_total / total:5.1f}%  "
              f"x{e.count:<5d} {e.key[:90]}")
    kinds = {"attention": ("flash", "efficient_attention", "cudnn", "fmha", "attention"),
             "matmul": ("gemm", "mm", "matmul", "linear", "nvjet", "cutlass"),
             "adam": ("adam", "foreach", "_fused"), "copies": ("copy", "cat", "fill", "to_copy")}
    shares = {k: 0.0 for k in kinds}
    for e in events:
        name = e.key.lower()
        kind = next((k for k, words in kinds.items() if any(w in name for w in words)), None)
        if kind:
            shares[kind] += e.self_device_time_total
    print("  profile shares (by op name, approximate): "
          + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in shares.items()), flush=True)


def run_row(folder: Path, path: str, resp_len: int, grad_ckpt: bool, args, port: int,
            keep_attention: bool = True) -> dict:
    from learner.learner_actor import LearnerRank
    from learner.objective import count_normalizer
    from protocols.config import load_config

    cuda = torch.cuda.is_available()
    total = args.prompt_len + resp_len
    if path == "old":
        learner_cfg = ["learner.logits_chunk_tokens=0", "learner.micro_batch_size=1", "learner.packing=false",
                       "learner.max_tokens_per_micro_batch=0"]
    else:
        learner_cfg = [f"learner.logits_chunk_tokens={args.chunk_tokens}", "learner.packing=true",
                       f"learner.max_tokens_per_micro_batch={total * args.per_micro_batch}"]
    cfg = load_config(None, [
        f"cluster.use_gpus={'true' if cuda else 'false'}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
        f"model.path={folder}", "algorithm.preset=dapo", "learner.zero_stage=2",
        f"learner.gradient_checkpointing={'true' if grad_ckpt else 'false'}",
        f"learner.uncheckpointed_layers={args.uncheckpointed_layers if path == 'new' else 0}",
        f"learner.checkpoint_keeps_attention={'true' if keep_attention and path == 'new' else 'false'}",
        f"learner.prompts_per_step={max(1, args.samples // 2)}",
        "rollout.samples_per_prompt=2", f"rollout.max_response_tokens={resp_len}",
        f"data.max_prompt_tokens={args.prompt_len}", *learner_cfg, *args.set])
    # samples_per_prompt must be >= 2 in the config; the rank trains the shard it is given, whatever its size.
    shard = make_shard(args.samples, args.prompt_len, resp_len, args.vocab, seed=resp_len)
    normalizer = count_normalizer(shard.loss_mask, resp_len)
    learner = LearnerRank(cfg, 0, 1, str(folder))
    out = {"path": path, "resp": resp_len, "gc": grad_ckpt, "samples": args.samples,
           "ka": keep_attention and path == "new" and grad_ckpt}
    try:
        learner.setup("127.0.0.1", port)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            metrics = learner.train_step(shard, normalizer)
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            metrics = learner.train_step(shard, normalizer)
        sync()
        out["s_per_step"] = (time.perf_counter() - t) / args.steps
        out["peak_gib"] = (torch.cuda.max_memory_allocated() / 2**30 if cuda
                           else metrics["learner/peak_gib_max"])
        out["loss"] = metrics["loss"]
        flops = args.samples * train_flops(args.shape, args.vocab, total)
        out["tflops"] = flops / out["s_per_step"] / 1e12
        out["mfu"] = out["tflops"] / bf16_peak_tflops(torch.cuda.get_device_name(0)) if cuda else float("nan")
        if args.profile:
            print(fmt(out), flush=True)
            profile_step(learner, shard, normalizer)
    finally:
        if learner.engine is not None and hasattr(learner.engine, "destroy"):
            learner.engine.destroy()
        del learner
    return out


def fmt(row: dict) -> str:
    gc_label = ("on+ka" if row.get("ka") else "on") if row["gc"] else "off"
    head = f"{row['path']:4} {row['resp']:7d} {gc_label:5}"
    if "error" in row:
        return f"{head} {row['error']}"
    tok_s = row['resp'] * row['samples'] / row['s_per_step']
    return (f"{head} {row['s_per_step']:8.3f} {tok_s:11.0f} {row['peak_gib']:8.2f} "
            f"{row['loss']:11.4e} {row['tflops']:8.1f} {100 * row['mfu']:5.1f}%")


HEADER = (f"{'path':4} {'resp':>7} {'gc':5} {'s/step':>8} {'resp tok/s':>11} {'peak GiB':>8} {'loss':>11} "
          f"{'TFLOP/s':>8} {'MFU':>6}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.5b", help="0.5b, 1.5b (benchmarks/_gpu_common.py SHAPES), tiny on CPU")
    ap.add_argument("--lengths", default="8192,32768,65536,131072", help="response tokens, comma list")
    ap.add_argument("--paths", default="old,new")
    ap.add_argument("--new-grad-ckpt", default="on", help="gradient checkpointing of the new path: on, off, on,off")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="learner.logits_chunk_tokens of the new path")
    ap.add_argument("--samples", type=int, default=1, help="samples per step (the issue's table used 8 at 8k)")
    ap.add_argument("--per-micro-batch", type=int, default=1,
                    help="new path: samples packed in one micro-batch (token budget = this x prompt + response)")
    ap.add_argument("--uncheckpointed-layers", type=int, default=0,
                    help="new path with checkpointing on: decoder layers left without it (learner.uncheckpointed_layers)")
    ap.add_argument("--keep-attention", default="on",
                    help="new path with checkpointing on: keep attention outputs (learner.checkpoint_keeps_attention, "
                         "'on+ka' rows): on, off, on,off")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every row, e.g. learner.fused_adamw=true (repeatable)")
    ap.add_argument("--profile", action="store_true", help="profile one more step of each row and print the top ops")
    ap.add_argument("--model-dir", default="",
                    help="reuse the model folder saved there by an earlier run of the same shape (built there if absent)")
    ap.add_argument("--allow-cpu", action="store_true", help="smoke-test the script on CPU (use --shape tiny)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("benchmarks/long_cot_gpu.py needs a CUDA GPU; --allow-cpu --shape tiny smoke-tests it on CPU",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device {dev}; torch {torch.__version__}; shape {args.shape}; prompt {args.prompt_len}; {args.samples} "
          f"sample(s) per step, {args.per_micro_batch} per new micro-batch; warm-up {args.warmup}, timed {args.steps}", flush=True)
    print(HEADER, flush=True)
    start = time.perf_counter()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="relayrl-long-cot-") as tmp:
        lengths = [int(x) for x in args.lengths.split(",")]
        root = Path(args.model_dir or tmp)
        folder = root / f"qwen2-{args.shape}"
        if not (folder / "config.json").exists():
            # The context must hold the longest prompt + response, or the learner refuses the sample by name.
            folder, _ = build_model_folder(args.shape, root, args.vocab, "cuda" if torch.cuda.is_available() else "cpu",
                                           max_positions=max(32768, args.prompt_len + max(lengths)))
        free_memory()
        for resp_len in lengths:
            for path in [p.strip() for p in args.paths.split(",")]:
                gcs = [True] if path == "old" else [g.strip() == "on" for g in args.new_grad_ckpt.split(",")]
                kas = [k.strip() == "on" for k in args.keep_attention.split(",")]
                variants = [(g, k) for g in gcs for k in (kas if g and path == "new" else [False])]
                for gc_on, keep in variants:
                    try:
                        row = run_row(folder, path, resp_len, gc_on, args, port, keep)
                    except torch.cuda.OutOfMemoryError as err:
                        row = {"path": path, "resp": resp_len, "gc": gc_on,
                               "error": f"OOM ({str(err).splitlines()[0][:120]})"}
                    except (RuntimeError, ValueError) as err:  # report the row and go on to the next
                        row = {"path": path, "resp": resp_len, "gc": gc_on,
                               "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                    gc.collect()  # the handled error's frames held the row's tensors; they are gone now
                    free_memory()
                    print(fmt(row), flush=True)
    print(f"# wall {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
