"""Rollout throughput against the number of rollout workers, through the real pipeline (controller, reward
workers, queue) with the learner taken out: the driver drains batches without training, so generation alone
sets the pace.

    python benchmarks/rollout_scaling.py --workers 1 3 --seconds 60
"""

import argparse
import tempfile
import time

import ray

from cluster.trainer import Trainer
from protocols.config import load_config


def measure(num_workers: int, seconds: float, overrides: list[str]) -> dict:
    out = tempfile.mkdtemp(prefix=f"relayrl_scaling_{num_workers}_")
    # A large staleness bound keeps admission open: no weights are published, so every worker stays at version 0.
    cfg = load_config(None, [f"output_dir={out}", f"rollout.num_workers={num_workers}", "train.max_staleness=100000",
                             "data.num_eval_prompts=1", *overrides])
    trainer = Trainer(cfg)
    try:
        refs = [w.run.remote() for w in trainer.rollout_workers]
        trainer._wait_for_batch()  # engines warm
        groups = tokens = 0
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            batch, _ = trainer._wait_for_batch()
            groups += len(batch)
            tokens += sum(len(t.response_token_ids) for g in batch for t in g.trajectories)
        elapsed = time.perf_counter() - start
        ray.get(trainer.controller.stop.remote())
        reports = ray.get(refs)
    finally:
        trainer.shutdown()
    return {"workers": num_workers, "groups_per_s": groups / elapsed, "tokens_per_s": tokens / elapsed,
            "idle_frac": sum(r["idle_s"] for r in reports) / sum(r["wall_s"] for r in reports)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--seconds", type=float, default=60)
    args, overrides = parser.parse_known_args()
    results = [measure(n, args.seconds, overrides) for n in args.workers]
    base = results[0]["tokens_per_s"]
    print(f"\n{'workers':<9}{'groups/s':>10}{'tokens/s':>10}{'vs first':>10}{'idle':>7}")
    for r in results:
        print(f"{r['workers']:<9}{r['groups_per_s']:>10.1f}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base:>9.2f}x"
              f"{r['idle_frac']:>7.2f}")


if __name__ == "__main__":
    main()
