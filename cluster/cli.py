"""`relayrl` command line: `relayrl train|config|plan [--config FILE] [--output-dir DIR] [section.key=value ...]`.

`plan` prints the placement a config asks for (roles, bundles, nodes) and refuses one the cluster cannot hold,
without starting any actor.
"""

import argparse
import json
import logging
import sys

from protocols.config import ConfigError, dump_config, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relayrl", description="Asynchronous actor-learner RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "run a training job (default: the embedded demo on this machine)"),
                            ("config", "print the resolved config and exit"),
                            ("plan", "print the placement the config asks for and check it against the cluster "
                                     "(cluster.address, or --node for offline planning); starts no actor")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", default=None, help="YAML run config; defaults are the embedded demo")
        p.add_argument("--output-dir", default=None, help="run folder (overrides output_dir)")
        if name == "plan":
            p.add_argument("--node", action="append", default=[], metavar="SPEC",
                           help="plan for these nodes instead of a live cluster, e.g. --node 2xGPU=8,CPU=96 "
                                "(repeatable; custom resources allowed: --node GPU=8,CPU=96,learner_node=8)")
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
    if args.command == "plan":
        return plan_command(cfg, args.node)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.placement import PlacementError
    from cluster.trainer import train

    try:
        summary = train(cfg)
    except PlacementError as err:
        print(f"relayrl: placement refused before any actor started: {err}", file=sys.stderr)
        return 3
    brief = {k: summary[k] for k in ("accuracy_before", "accuracy_after", "steps", "wall_seconds", "final_model")}
    print(json.dumps(brief, indent=2))
    return 0


def plan_command(cfg, node_specs: list[str]) -> int:
    """Print the plan against --node specs, the cluster at cluster.address (joined as a client, no actor
    started), or the embedded cluster this machine would start. Exit 3 when the plan cannot fit."""
    from cluster.placement import (PlacementError, check_plan, describe, local_nodes, nodes_from_ray,
                                   parse_node_spec, plan_placement)

    plan = plan_placement(cfg)
    try:
        if node_specs:
            nodes, source = [n for spec in node_specs for n in parse_node_spec(spec)], "the --node specs"
            nodes = [type(n)(f"node{i}", n.resources) for i, n in enumerate(nodes)]
        elif cfg.cluster.address:
            import ray

            joined = not ray.is_initialized()
            if joined:
                ray.init(address=cfg.cluster.address, log_to_driver=False, logging_level="ERROR")
            try:
                nodes, source = nodes_from_ray(), f"the cluster at cluster.address={cfg.cluster.address!r}"
            finally:
                if joined:
                    ray.shutdown()
        else:
            nodes, source = local_nodes(cfg), "the embedded local cluster (cluster.address is empty)"
    except (ValueError, ConnectionError, RuntimeError) as err:
        print(f"relayrl plan: {err}", file=sys.stderr)
        return 2
    print(f"placement for {source}:")
    try:
        assignment = check_plan(plan, nodes)
    except PlacementError as err:
        print(describe(plan, nodes, None))
        print(f"relayrl plan: refused: {err}", file=sys.stderr)
        return 3
    print(describe(plan, nodes, assignment))
    print("(predicted nodes; Ray places the bundles when the run starts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
