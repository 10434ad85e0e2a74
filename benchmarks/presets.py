"""Runs the demo job once per algorithm preset and prints held-out greedy accuracy before and after.

    python benchmarks/presets.py --steps 400 grpo dr_grpo dapo gspo cispo rloo ppo
Extra `section.key=value` arguments apply to every run; `ppo` gets `critic.num_workers=1` unless given.
"""

import argparse
import json
import tempfile

from cluster.trainer import Trainer
from protocols.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("presets", nargs="*", default=["grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo"])
    args, overrides = parser.parse_known_args()
    # `key=value` words land among the positional presets; they are overrides
    overrides += [p for p in args.presets if "=" in p]
    args.presets = [p for p in args.presets if "=" not in p] or parser.get_default("presets")
    results = []
    for preset in args.presets:
        out = tempfile.mkdtemp(prefix=f"relayrl_preset_{preset}_")
        # ppo's GAE needs the critic group; the critic-free presets refuse one.
        critic = ["critic.num_workers=1"] if preset == "ppo" and not any(o.startswith("critic.num_workers")
                                                                          for o in overrides) else []
        cfg = load_config(None, [f"output_dir={out}", f"train.steps={args.steps}", f"algorithm.preset={preset}",
                                 *critic, *overrides])
        trainer = Trainer(cfg)
        try:
            summary = trainer.run()
        finally:
            trainer.shutdown()
        results.append((preset, summary["accuracy_before"], summary["accuracy_after"], summary["wall_seconds"]))
        print(json.dumps({"preset": preset, **{k: summary[k] for k in ("accuracy_before", "accuracy_after")}}),
              flush=True)
    print(f"\n{'preset':<14}{'before':>8}{'after':>8}{'gain':>8}{'wall s':>9}")
    for preset, before, after, wall in results:
        print(f"{preset:<14}{before:>8.3f}{after:>8.3f}{after - before:>+8.3f}{wall:>9.0f}")


if __name__ == "__main__":
    main()
