"""The learner's memory and time with the reference model inside every rank against reference workers, in one run.

    python benchmarks/reference_memory.py                        # both parts, on CPU
    python benchmarks/reference_memory.py --part learner --layers 8
    python benchmarks/reference_memory.py --part learner --gpu --shape 1.5b   # on a GPU: peak GPU memory

With --gpu the learner part runs the rank and the reference worker in this process, one after the other (the
GPU machine has no Ray), and reads the GPU allocator: memory held after setup and the peak during steps.

Part `learner`: one learner rank (DeepSpeed ZeRO-2) of a random-init model, preset grpo (KL in the loss), on
the same synthetic batch, twice: with the in-learner reference (reference.num_workers=0) and with the reference
log-probs supplied by a ReferenceWorker actor (reference.num_workers=1, the learner holds no copy). It prints
the rank's host RSS after setup and its peak during a step (VmHWM; on a GPU the allocator's peak), the median
train_step seconds, and the ratios. The reference worker's own memory and its seconds per batch are printed
beside them: with the group on, that work moves off the learner into the stream, it does not vanish.

Part `pipeline`: the demo job (grpo, max_staleness 1) for --steps steps with the in-learner reference and with
one reference worker streaming; prints the median driver step time and learner time over the steps after a
warm-up, and their ratios. On this 2-core machine the reference worker competes with the rollout engine and
the learner for the same cores, so the ratio here is a floor for what separate devices give.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._gpu_common import free_memory, free_port, peak_gib, reset_peak, sync  # noqa: E402

GIB = 2**30


def _memory(_actor=None) -> dict[str, float]:
    """Inside an actor (via __ray_call__): its resident set now and its peak (VmHWM), in GiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024 / GIB
    return out


def build_model(root: Path, args) -> str:
    """A demo-tokenizer Qwen2 of the requested width and depth (random init), or a named GPU shape."""
    if args.shape:
        from benchmarks._gpu_common import build_model_folder

        folder, _ = build_model_folder(args.shape, root, 151936, "cuda" if args.gpu else "cpu", max_positions=4096)
        return str(folder)
    from demos.arithmetic_model import build_random_model

    return build_random_model(root / "model", tied=False, hidden=args.hidden, layers=args.layers,
                              heads=args.hidden // 64, kv_heads=max(1, args.hidden // 256), head_dim=64,
                              intermediate=4 * args.hidden, max_positions=512, seed=0)


def synthetic_samples(num: int, prompt_len: int, response_len: int, vocab: int):
    from protocols.training_batch import TrainingBatch

    g = torch.Generator().manual_seed(0)
    return TrainingBatch.from_samples(
        [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(num)],
        [torch.randint(3, vocab, (response_len,), generator=g).tolist() for _ in range(num)],
        [[-2.5] * response_len for _ in range(num)],
        advantages=[[1.0 if i % 2 else -1.0] * response_len for i in range(num)])


def learner_reading(cfg, model: str, samples, steps: int) -> dict:
    import ray

    from cluster.learner_group import LearnerGroup
    from learner.objective import count_normalizer

    normalizer = count_normalizer(samples.loss_mask, cfg.rollout.max_response_tokens)
    group = LearnerGroup(cfg, model)
    try:
        rank = group.ranks[0]
        after_setup = ray.get(rank.__ray_call__.remote(_memory))["VmRSS"]
        holds_ref = ray.get(rank.__ray_call__.remote(lambda r: r.ref_model is not None))
        seconds, peaks = [], []
        for _ in range(steps):
            start = time.perf_counter()
            metrics = group.train_step(samples, normalizer)
            seconds.append(time.perf_counter() - start)
            peaks.append(metrics["learner/peak_gib_max"])
    finally:
        group.shutdown()
    return {"rss_after_setup_gib": after_setup, "peak_gib": max(peaks), "step_s": statistics.median(seconds[1:]),
            "holds_reference": holds_ref, "kl": metrics.get("kl", float("nan"))}


def learner_reading_here(cfg, model: str, samples, steps: int, port: int) -> dict:
    """--gpu: the same reading with the rank in this process; GPU memory held after setup and its peak."""
    from learner.learner_actor import LearnerRank
    from learner.objective import count_normalizer

    normalizer = count_normalizer(samples.loss_mask, cfg.rollout.max_response_tokens)
    free_memory()
    reset_peak()
    rank = LearnerRank(cfg, 0, 1, model)
    try:
        rank.setup("127.0.0.1", port)
        after_setup = torch.cuda.memory_allocated() / GIB if torch.cuda.is_available() else _memory()["VmRSS"]
        holds_ref = rank.ref_model is not None
        seconds = []
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            metrics = rank.train_step(samples, normalizer)
            sync()
            seconds.append(time.perf_counter() - start)
        peak = peak_gib() if torch.cuda.is_available() else metrics["learner/peak_gib_max"]
    finally:
        if rank.engine is not None and hasattr(rank.engine, "destroy"):
            rank.engine.destroy()
        del rank
        free_memory()
    return {"rss_after_setup_gib": after_setup, "peak_gib": peak, "step_s": statistics.median(seconds[1:]),
            "holds_reference": holds_ref, "kl": metrics.get("kl", float("nan"))}


def part_learner_here(args) -> dict:
    """The learner part with no Ray: each setting's rank, then the reference worker, in this process."""
    from actors.reference_worker import ReferenceWorker
    from learner.batch import pad_per_token

    root = Path(tempfile.mkdtemp(prefix="relayrl_refmem_"))
    model = build_model(root, args)
    in_learner, streamed = learner_configs(args)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    samples = synthetic_samples(args.samples, args.prompt_len, args.response_len, vocab)
    port = free_port()
    with_ref = learner_reading_here(in_learner, model, samples, args.steps, port)
    reset_peak()
    worker = ReferenceWorker(streamed, 0, model)
    try:
        sync()
        start = time.perf_counter()
        ref_rows = worker.score_batch(samples)
        sync()
        ref_s = time.perf_counter() - start
        worker_peak = peak_gib() if torch.cuda.is_available() else _memory()["VmHWM"]
    finally:
        del worker
        free_memory()
    samples = samples.with_fields(ref_logprobs=pad_per_token(ref_rows, samples.width))
    without_ref = learner_reading_here(streamed, model, samples, args.steps, port)
    return {"model_params": parameter_count(model), "in_learner": with_ref, "reference_workers": without_ref,
            "reference_worker_rss_gib": worker_peak, "reference_worker_s_per_batch": ref_s}


def learner_configs(args):
    """The two settings of the learner part: the in-learner reference, and reference log-probs from workers."""
    from protocols.config import load_config

    common = ["algorithm.preset=grpo", f"learner.prompts_per_step={args.samples // 8}", "rollout.samples_per_prompt=8",
              f"learner.micro_batch_size={args.micro_batch}", f"rollout.max_response_tokens={args.response_len}",
              f"data.max_prompt_tokens={args.prompt_len}", f"cluster.use_gpus={str(args.gpu).lower()}",
              f"model.dtype={'bfloat16' if args.gpu else 'float32'}"]
    return load_config(None, common + ["reference.num_workers=0"]), load_config(None, common + ["reference.num_workers=1"])


def parameter_count(model: str) -> int:
    from safetensors.torch import load_file

    return sum(v.numel() for shard in Path(model).glob("*.safetensors") for v in load_file(shard).values())


def part_learner(args) -> dict:
    if args.gpu or args.here:
        return part_learner_here(args)
    import ray

    from actors.reference_worker import ReferenceWorker
    from cluster.ray_setup import start_ray
    from learner.batch import pad_per_token

    root = Path(tempfile.mkdtemp(prefix="relayrl_refmem_"))
    model = build_model(root, args)
    in_learner, streamed = learner_configs(args)
    start_ray(in_learner)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    samples = synthetic_samples(args.samples, args.prompt_len, args.response_len, vocab)

    with_ref = learner_reading(in_learner, model, samples, args.steps)
    worker = ray.remote(ReferenceWorker).options(num_cpus=1, num_gpus=1 if args.gpu else 0).remote(streamed, 0, model)
    try:
        start = time.perf_counter()
        ref_rows = ray.get(worker.score_batch.remote(samples))
        samples = samples.with_fields(ref_logprobs=pad_per_token(ref_rows, samples.width))
        ref_s = time.perf_counter() - start
        worker_rss = ray.get(worker.__ray_call__.remote(_memory))["VmRSS"]
    finally:
        ray.kill(worker)
    without_ref = learner_reading(streamed, model, samples, args.steps)
    return {"model_params": parameter_count(model), "in_learner": with_ref, "reference_workers": without_ref,
            "reference_worker_rss_gib": worker_rss, "reference_worker_s_per_batch": ref_s}


def part_pipeline(args) -> dict:
    from cluster.trainer import Trainer
    from protocols.config import load_config

    out = {}
    for label, workers in (("in_learner", 0), ("reference_workers", 1)):
        folder = Path(tempfile.mkdtemp(prefix=f"relayrl_refpipe_{label}_"))
        cfg = load_config(None, [f"output_dir={folder}", "algorithm.preset=grpo", f"train.steps={args.steps_pipeline}",
                                 "data.num_eval_prompts=20", f"reference.num_workers={workers}"])
        trainer = Trainer(cfg)
        try:
            trainer.run()
        finally:
            trainer.shutdown()
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][args.warmup:]
        out[label] = {key: statistics.median(r[f"time/{key}"] for r in rows) for key in ("step_s", "learner_s", "wait_s")}
        out[label]["kl_last"] = rows[-1]["kl"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("learner", "pipeline", "both"), default="both")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shape", default="", help="a named shape of benchmarks/_gpu_common.py (0.5b, 1.5b)")
    parser.add_argument("--gpu", action="store_true", help="run the learner part on a GPU (bf16)")
    parser.add_argument("--here", action="store_true",
                        help="learner part in this process, no Ray (implied by --gpu: the GPU machine has no Ray)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="learner steps per setting (the first is a warm-up)")
    parser.add_argument("--steps-pipeline", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="pipeline steps left out of the medians")
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    args = parser.parse_args()
    results = {}
    if args.part in ("learner", "both"):
        r = part_learner(args)
        results["learner"] = r
        a, b = r["in_learner"], r["reference_workers"]
        print(f"learner rank, {r['model_params'] / 1e6:.1f}M parameters, {args.samples} samples x "
              f"({args.prompt_len} + {args.response_len}) tokens, preset grpo (KL in the loss)")
        print(f"{'':28s}{'in-learner ref':>16s}{'ref workers':>14s}{'ratio':>8s}")
        held = "GPU memory after setup (GiB)" if args.gpu else "RSS after setup (GiB)"  # host RSS on CPU
        for key, name in (("rss_after_setup_gib", held), ("peak_gib", "peak during step (GiB)"),
                          ("step_s", "train_step (s, median)")):
            print(f"{name:28s}{a[key]:16.3f}{b[key]:14.3f}{b[key] / a[key]:8.2f}")
        print(f"holds a reference copy: {a['holds_reference']} / {b['holds_reference']}; "
              f"KL metric {a['kl']:.2e} / {b['kl']:.2e}")
        print(f"reference worker: {'GPU peak' if args.gpu else 'RSS'} {r['reference_worker_rss_gib']:.3f} GiB, "
              f"{r['reference_worker_s_per_batch']:.3f} s per batch (off the learner, in the stream)")
    if args.part in ("pipeline", "both"):
        p = part_pipeline(args)
        results["pipeline"] = p
        a, b = p["in_learner"], p["reference_workers"]
        print(f"demo job, grpo, {args.steps_pipeline} steps (medians after {args.warmup})")
        print(f"{'':28s}{'in-learner ref':>16s}{'ref workers':>14s}{'ratio':>8s}")
        for key in ("step_s", "learner_s", "wait_s"):
            print(f"{'time/' + key:28s}{a[key]:16.3f}{b[key]:14.3f}{b[key] / max(a[key], 1e-9):8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
