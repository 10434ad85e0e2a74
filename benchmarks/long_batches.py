"""Long-tailed batches on the learner, on CPU: how much of the processed work is real tokens, and how the
learner's peak memory follows response length at a fixed token budget.

    python benchmarks/long_batches.py                 # both tables (the memory one takes a few minutes)
    python benchmarks/long_batches.py --skip-memory   # the effective-token table only (seconds)

Table 1: a batch of 128 samples, prompt 256 tokens, response lengths lognormal with median 3,000 and 5% at the
16,384-token limit (clipped there, as truncated responses are), over 1 and 4 ranks, three ways to batch it:
  samples   today's micro-batches of --micro-batch-size samples, in arrival order, padded to the longest
  budget    learner.max_tokens_per_micro_batch, ranks balanced by tokens, padded micro-batches of similar
            lengths (rows x longest within the budget)
  packed    the same budget with learner.packing: one row per micro-batch, no padding
effective = real tokens / processed tokens (padding and the masked filler micro-batches that keep ranks in step
count as processed). The planning is the learner's own (learner.micro_batches, learner.batch).

Table 2: LearnerRank.train_step itself (DeepSpeed ZeRO-2, fp32, one rank, tiny Qwen2 with a --vocab vocabulary)
on 4 samples per step at growing response lengths, each row in a fresh process so its peak resident set is its
own: today's path (sample micro-batches, full logits) against token budget + packing + chunked LM head.
Seconds are printed for completeness only: on a shared 2-core machine they are dominated by other load.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.micro_batches import plan_ranks, sample_count_micro_batches, token_budget_micro_batches  # noqa: E402


def long_tailed_lengths(n: int, median: int, limit: int, tail_frac: float, seed: int) -> list[int]:
    """Lognormal response lengths with the given median; sigma chosen so that tail_frac of them reach limit."""
    # P(X >= limit) = tail_frac  <=>  (ln limit - ln median) / sigma = z, the (1 - tail_frac) normal quantile
    z = _normal_quantile(1 - tail_frac)
    sigma = (math.log(limit) - math.log(median)) / z
    rng = random.Random(seed)
    return [min(limit, max(1, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def _normal_quantile(p: float) -> float:
    lo, hi = -10.0, 10.0
    for _ in range(100):  # bisection on the normal CDF
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < p:
            lo = mid
        else:
            hi = mid
    return lo


def processed_tokens(prompts: list[int], responses: list[int], plan: list[list[int]], packed: bool) -> int:
    """What collate / collate_packed would hand the model for each micro-batch; empty micro-batches run the
    rank's shortest sample (masked)."""
    total = 0
    shortest = min(range(len(prompts)), key=lambda i: prompts[i] + responses[i])
    for idx in plan:
        rows = idx or [shortest]
        if packed:
            total += sum(prompts[i] + responses[i] for i in rows)
        else:  # left-padded prompts to the widest, right-padded responses to the longest
            total += len(rows) * (max(prompts[i] for i in rows) + max(max(responses[i] for i in rows), 1))
    return total


def effective_table(args) -> list[str]:
    responses = long_tailed_lengths(args.samples, args.median, args.limit, args.tail_frac, args.seed)
    prompts = [args.prompt_len] * args.samples
    tokens = [p + r for p, r in zip(prompts, responses)]
    real = sum(tokens)
    at_limit = sum(r == args.limit for r in responses) / len(responses)
    lines = [f"batch: {args.samples} samples, prompt {args.prompt_len}, responses median "
             f"{sorted(responses)[len(responses) // 2]}, mean {sum(responses) / len(responses):.0f}, "
             f"{at_limit:.1%} at the {args.limit} limit; {real} real tokens; budget "
             f"{args.budget} tokens, sample micro-batches of {args.micro_batch_size}",
             f"{'ranks':>5} {'batching':8} {'micro-batches/rank':>18} {'processed':>11} {'effective':>9}"]
    for ranks in (1, 4):
        for mode in ("samples", "budget", "packed"):
            budget = 0 if mode == "samples" else args.budget
            if mode == "samples":  # today: contiguous equal shards, consecutive micro-batches
                per = args.samples // ranks
                parts = [list(range(r * per, (r + 1) * per)) for r in range(ranks)]
            else:
                parts = plan_ranks(tokens, ranks, budget)
            plans = []
            for idx in parts:
                local = [tokens[i] for i in idx]
                if mode == "samples":
                    plans.append(sample_count_micro_batches(len(idx), args.micro_batch_size))
                else:
                    plans.append(token_budget_micro_batches(local, budget, padded=mode == "budget"))
            count = max(len(p) for p in plans)
            total = 0
            for idx, plan in zip(parts, plans):
                if mode != "samples":
                    plan = token_budget_micro_batches([tokens[i] for i in idx], budget, count=count,
                                                      padded=mode == "budget")
                total += processed_tokens([prompts[i] for i in idx], [responses[i] for i in idx], plan,
                                          packed=mode == "packed")
            lines.append(f"{ranks:5d} {mode:8} {count:18d} {total:11d} {real / total:9.3f}")
    return lines


# ------------------------------------------------------------------------------------------ peak memory rows


def memory_row(args) -> dict:
    """One train_step measurement in this process (run as a child): peak RSS of the step, in GiB."""
    import torch

    from benchmarks._gpu_common import free_port
    from learner.learner_actor import LearnerRank
    from learner.objective import count_normalizer
    from protocols.config import load_config
    from protocols.training_batch import TrainingBatch

    n, resp, prompt = args.row_samples, args.row_resp, args.prompt_len
    g = torch.Generator().manual_seed(resp)
    shard = TrainingBatch.from_samples(
        torch.randint(0, args.vocab, (n, prompt), generator=g).tolist(),
        torch.randint(0, args.vocab, (n, resp), generator=g).tolist(), [[-2.0] * resp for _ in range(n)],
        advantages=[[1.0 if i % 2 else -1.0] * resp for i in range(n)])
    if args.row_path == "old":
        learner_cfg = [f"learner.micro_batch_size={args.old_micro_batch}", "learner.logits_chunk_tokens=0"]
    else:
        learner_cfg = [f"learner.max_tokens_per_micro_batch={args.memory_budget}", "learner.packing=true",
                       f"learner.logits_chunk_tokens={args.chunk_tokens}"]
    cfg = load_config(None, ["algorithm.preset=dapo", "learner.prompts_per_step=1", f"rollout.samples_per_prompt={n}",
                             f"rollout.max_response_tokens={resp}", "learner.gradient_checkpointing=true",
                             *learner_cfg])
    learner = LearnerRank(cfg, 0, 1, args.row_model)
    learner.setup("127.0.0.1", free_port())
    norm = count_normalizer(shard.loss_mask, resp)
    learner.train_step(shard, norm)  # warm-up: optimizer state exists from here on
    t = time.perf_counter()
    metrics = learner.train_step(shard, norm)
    return {"peak_gib": metrics["learner/peak_gib_max"], "s": time.perf_counter() - t,
            "micro_batches": metrics["learner/micro_batches_max"]}


def memory_table(args) -> list[str]:
    from benchmarks._gpu_common import build_model_folder

    lines = [f"learner peak RSS per train_step (GiB), tiny Qwen2 (hidden 64, 2 layers), vocab {args.vocab}, "
             f"{args.row_samples} samples/step, prompt {args.prompt_len}, fp32, gradient checkpointing on; "
             f"old: {args.old_micro_batch} samples per micro-batch, full logits; new: budget {args.memory_budget} "
             f"tokens, packing, LM head in chunks of {args.chunk_tokens}",
             f"{'response':>8} {'old GiB':>8} {'new GiB':>8} {'new/old':>7} {'old s':>6} {'new s':>6} {'new mb':>6}"]
    print(lines[0])
    print(lines[1], flush=True)
    with tempfile.TemporaryDirectory(prefix="relayrl-long-batches-") as tmp:
        folder, _ = build_model_folder("tiny", Path(tmp), args.vocab, "cpu")
        for resp in [int(x) for x in args.memory_lengths.split(",")]:
            row = {}
            for path in ("old", "new"):
                cmd = [sys.executable, __file__, "--row-path", path, "--row-resp", str(resp), "--row-model",
                       str(folder), *sys.argv[1:]]
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
                last = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
                if out.returncode or not last:
                    print(out.stderr[-3000:], file=sys.stderr)
                    row[path] = {"peak_gib": float("nan"), "s": float("nan"), "micro_batches": 0}
                else:
                    row[path] = json.loads(last[-1])
            o, n = row["old"], row["new"]
            lines.append(f"{resp:8d} {o['peak_gib']:8.2f} {n['peak_gib']:8.2f} {n['peak_gib'] / o['peak_gib']:7.2f} "
                         f"{o['s']:6.1f} {n['s']:6.1f} {int(n['micro_batches']):6d}")
            print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--median", type=int, default=3000)
    ap.add_argument("--limit", type=int, default=16384)
    ap.add_argument("--tail-frac", type=float, default=0.05)
    ap.add_argument("--budget", type=int, default=32768, help="learner.max_tokens_per_micro_batch for table 1")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="today's samples per micro-batch, table 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--memory-lengths", default="512,1024,2048,4096")
    ap.add_argument("--memory-budget", type=int, default=2048)
    ap.add_argument("--row-samples", type=int, default=4)
    ap.add_argument("--old-micro-batch", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    # internal: one memory row in a child process
    ap.add_argument("--row-path", choices=("old", "new"), help=argparse.SUPPRESS)
    ap.add_argument("--row-resp", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--row-model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.row_path:
        import os

        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        print(json.dumps(memory_row(args)), flush=True)
        return 0
    for line in effective_table(args):
        print(line, flush=True)
    if not args.skip_memory:
        print()
        memory_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
