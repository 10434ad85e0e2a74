"""Real-stack benchmark: the demo job synchronously (max_staleness 0) and asynchronously, in one run.

Prints rollout and learner tokens/s, seconds per weight sync, the share of training wall time in each phase,
and the async/sync wall-time ratio with each side's learner and rollout idle fractions.
    python benchmarks/pipeline.py --steps 100 --max-staleness 2
"""

import argparse
import json
import tempfile
from pathlib import Path

from cluster.trainer import Trainer
from protocols.config import load_config


def run(label: str, steps: int, overrides: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"relayrl_bench_{label}_"))
    cfg = load_config(None, [f"output_dir={out}", f"train.steps={steps}", "data.num_eval_prompts=50", *overrides])
    trainer = Trainer(cfg)
    try:
        summary = trainer.run()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    phases = summary["phase_seconds"]
    train_s = summary["train_seconds"]
    workers = summary["rollout"]
    gen_s = sum(w["generate_s"] for w in workers)
    tokens = sum(w["tokens"] for w in workers)
    syncs = sum(len(w["versions_seen"]) - 1 for w in workers)
    learner_tokens = sum(r["num_tokens"] for r in rows)
    return {
        "label": label,
        "train_s": train_s,
        "steps_per_s": steps / train_s,
        "rollout_tokens_per_s": tokens / max(gen_s, 1e-9),
        "learner_tokens_per_s": learner_tokens / max(phases["learner_s"], 1e-9),
        "publish_s_per_step": phases["publish_s"] / steps,
        "load_s_per_sync": sum(w["sync_s"] for w in workers) / max(syncs, 1),
        "share_wait": phases["wait_s"] / train_s,
        "share_learner": phases["learner_s"] / train_s,
        "share_publish": phases["publish_s"] / train_s,
        "learner_idle_frac": phases["wait_s"] / train_s,
        "rollout_idle_frac": sum(w["idle_s"] for w in workers) / max(sum(w["wall_s"] for w in workers), 1e-9),
        "accuracy": (summary["accuracy_before"], summary["accuracy_after"]),
        "max_staleness_seen": max(r["staleness/max"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--rollout-workers", type=int, default=1)
    args, extra = parser.parse_known_args()
    common = [f"rollout.num_workers={args.rollout_workers}", *extra]
    sync = run("sync", args.steps, ["train.max_staleness=0", *common])
    async_ = run("async", args.steps, [f"train.max_staleness={args.max_staleness}", "train.partial_rollouts=true",
                                       *common])
    keys = [k for k in sync if k != "label"]
    print(f"\n{'metric':<24}{'sync (k=0)':>16}{f'async (k={args.max_staleness})':>16}")
    for key in keys:
        a, b = sync[key], async_[key]
        fmt = (lambda v: f"{v[0]:.2f}->{v[1]:.2f}") if isinstance(a, tuple) else (lambda v: f"{v:.3f}")
        print(f"{key:<24}{fmt(a):>16}{fmt(b):>16}")
    print(f"\nwall-time ratio sync/async for {args.steps} steps: {sync['train_s'] / async_['train_s']:.2f}x")


if __name__ == "__main__":
    main()
