"""The step time of a short PPO run (the demo with `algorithm.preset=ppo`), for comparing checkouts: run it with
each checkout first on PYTHONPATH, one after the other. Prints the medians of the step, the learner's time and
the wait for a batch over the steps after `--warmup`, the held-out accuracy and the groups dropped.

    PYTHONPATH=/path/to/checkout python benchmarks/critic_step.py --steps 20 [key=value ...]
"""

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from cluster.trainer import Trainer
from protocols.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    args, extra = parser.parse_known_args()
    out = Path(tempfile.mkdtemp(prefix="relayrl_critic_step_"))
    cfg = load_config(None, [f"output_dir={out}", "logging.plots=false", "algorithm.preset=ppo",
                             "critic.num_workers=1", f"train.steps={args.steps}", "data.num_eval_prompts=20",
                             "train.save_every=0", *extra])
    trainer = Trainer(cfg)
    try:
        summary = trainer.run()
    finally:
        trainer.shutdown()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    dropped = sum(v for k, v in summary["queue"].items() if k.startswith("queue/dropped_"))

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"PPO demo, steps {args.warmup + 1}-{args.steps}: median step {median('time/step_s'):.3f} s, median learner "
          f"{median('time/learner_s'):.3f} s, median wait {median('time/wait_s'):.3f} s, wall "
          f"{summary['wall_seconds']:.0f} s, accuracy {summary['accuracy_before']:.2f} -> "
          f"{summary['accuracy_after']:.2f}, dropped {dropped}")


if __name__ == "__main__":
    main()
