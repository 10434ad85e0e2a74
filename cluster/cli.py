"""`relayrl` command line: `relayrl train [--config FILE] [--output-dir DIR] [section.key=value ...]`."""

import argparse
import json
import logging
import sys

from protocols.config import ConfigError, dump_config, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relayrl", description="Asynchronous actor-learner RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "run a training job (default: the embedded demo on this machine)"),
                            ("config", "print the resolved config and exit")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", default=None, help="YAML run config; defaults are the embedded demo")
        p.add_argument("--output-dir", default=None, help="run folder (overrides output_dir)")
        p.add_argument("overrides", nargs="*", help="section.key=value, e.g. learner.lr=1e-4 rollout.num_workers=2")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    try:
        cfg = load_config(args.config, overrides)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"relayrl: {err}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(dump_config(cfg))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.trainer import train

    summary = train(cfg)
    brief = {k: summary[k] for k in ("accuracy_before", "accuracy_after", "steps", "wall_seconds", "final_model")}
    print(json.dumps(brief, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
