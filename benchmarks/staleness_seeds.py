"""Does asynchrony cost accuracy? The demo job at several max_staleness values and seeds, held-out accuracy each.

    python benchmarks/staleness_seeds.py --seeds 0 1 2 --staleness 0 1 2 --steps 500
"""

import argparse
import statistics
import tempfile

from cluster.trainer import Trainer
from protocols.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500)
    args, overrides = parser.parse_known_args()
    table: dict[int, list[tuple[float, float, float]]] = {k: [] for k in args.staleness}
    for seed in args.seeds:
        for k in args.staleness:
            out = tempfile.mkdtemp(prefix=f"relayrl_k{k}_s{seed}_")
            cfg = load_config(None, [f"output_dir={out}", f"train.steps={args.steps}", f"train.seed={seed}",
                                     f"train.max_staleness={k}", *overrides])
            trainer = Trainer(cfg)
            try:
                s = trainer.run()
            finally:
                trainer.shutdown()
            table[k].append((s["accuracy_before"], s["accuracy_after"], s["train_seconds"]))
            print(f"k={k} seed={seed} before={s['accuracy_before']:.3f} after={s['accuracy_after']:.3f} "
                  f"train_s={s['train_seconds']:.0f}", flush=True)
    print(f"\n{'max_staleness':<14}{'after (per seed)':>26}{'mean':>8}{'spread':>8}{'train s':>9}")
    for k, rows in table.items():
        after = [r[1] for r in rows]
        print(f"{k:<14}{' '.join(f'{a:.3f}' for a in after):>26}{statistics.mean(after):>8.3f}"
              f"{max(after) - min(after):>8.3f}{statistics.mean(r[2] for r in rows):>9.0f}")


if __name__ == "__main__":
    main()
