"""`python -m cli.node_resources NUM_NODES GPUS CPUS [relayrl train ARGS]`: what deploy/slurm/relayrl.sbatch starts
each node's Ray with. Prints one JSON object of custom resources per node (head first; `{}` for none), from the
config's cluster.*_resources (cluster.placement.node_resources), after checking the run's plan on exactly those
nodes. Exit 3, naming the settings, when the allocation cannot hold the plan."""

import argparse
import json
import sys
from pathlib import Path

from cluster.placement import Node, check_plan, node_resources, plan_placement
from protocols.config import load_config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="cli.node_resources")
    parser.add_argument("num_nodes", type=int)
    parser.add_argument("gpus", type=float, help="GPUs each node offers Ray")
    parser.add_argument("cpus", type=float, help="CPUs each node offers Ray")
    # the config options of `relayrl train`; its other flags (--dry-run, --node) do not change the plan
    parser.add_argument("--config", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--output-dir", default=None)
    args, rest = parser.parse_known_args(argv)
    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    config = args.config or (str(Path(args.resume) / "config.yaml") if args.resume else None)
    try:
        cfg = load_config(config, overrides)
        extra = node_resources(cfg, args.num_nodes)
        nodes = [Node(f"node{i}", {"CPU": args.cpus, "GPU": args.gpus, **res}) for i, res in enumerate(extra)]
        check_plan(plan_placement(cfg), nodes)
    except (ValueError, FileNotFoundError) as err:  # ConfigError and PlacementError are ValueErrors
        print(f"relayrl.sbatch: {err}", file=sys.stderr)
        return 3
    for res in extra:
        print(json.dumps({k: int(v) if float(v).is_integer() else v for k, v in res.items()}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
