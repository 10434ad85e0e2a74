"""`relayrl` command line: `relayrl train|config|plan [--config FILE] [--output-dir DIR] [section.key=value ...]`
`relayrl plot RUN_DIR`, `relayrl eval --model PATH --data NAME_OR_FILE --samples K`, and
`relayrl scale RUN_DIR --rollout-workers N` (resize a running job's rollout pool; cluster/scale_requests.py).

`train --resume RUN_DIR` continues that run from its newest complete checkpoint, with RUN_DIR/config.yaml as
the config unless --config is given (overrides apply on top; settings that fix shapes must not change).

`plan` prints the placement a config asks for (roles, bundles, nodes) and refuses one the cluster cannot hold,
without starting any actor. `train --dry-run` checks the config, model folder, data and placement and prints what
the run would start (cli/dry_run.py). `plot` draws a run folder's metrics.jsonl as PNGs (cli/plots.py).
`eval` runs the evaluation harness (cluster/evaluation.py) on a model folder.
"""

import argparse
import json
import logging
import sys

from protocols.config import ConfigError, dump_config, load_config

CONFIG_ERRORS = (ConfigError, ValueError, FileNotFoundError)
"""A bad config file, override, path or field: `train` and `eval` say which and exit 2 before anything starts."""


def refuse(prog: str, message: object, code: int = 2) -> int:
    """Say on stderr why `prog` stops and return its exit code (2: bad input, 3: placement refused)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return code


def refuse_placement(prog: str, err: Exception) -> int:
    return refuse(prog, f"placement refused before any actor started: {err}", 3)


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
        if name == "train":
            p.add_argument("--resume", default=None, metavar="RUN_DIR",
                           help="continue the run in RUN_DIR from its newest complete checkpoint (its config.yaml "
                                "is the config unless --config is given)")
        if name in ("plan", "train"):
            p.add_argument("--node", action="append", default=[], metavar="SPEC",
                           help="plan for these nodes instead of a live cluster, e.g. --node 2xGPU=8,CPU=96 "
                                "(repeatable; custom resources allowed: --node GPU=8,CPU=96,learner_node=8)"
                                + ("; with --dry-run only" if name == "train" else ""))
        if name == "train":
            p.add_argument("--dry-run", action="store_true",
                           help="check the config, model folder, data files and placement, print what the run "
                                "would start, and exit (exit 2 on any error); starts no Ray or actor")
        p.add_argument("overrides", nargs="*", help="section.key=value, e.g. learner.lr=1e-4 rollout.num_workers=2")
    p = sub.add_parser("plot", help="draw a run folder's metrics.jsonl as PNG figures (RUN_DIR/plots/)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `relayrl train` (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default RUN_DIR/plots)")
    p = sub.add_parser("scale", help="resize a running job's rollout pool (applied between two steps)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (output_dir) of a running job")
    p.add_argument("--rollout-workers", type=worker_count, required=True, metavar="N",
                   help="rollout workers wanted (an integer >= 1)")
    p.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                   help="wait this long for the job to apply it and print the result (0: return at once)")
    add_eval_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "scale":
        return scale_command(args.run_dir, args.rollout_workers, args.wait)
    if args.command == "eval":
        return eval_command(args)
    if args.command == "plot":
        return plot_command(args.run_dir, args.out)
    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    resume = getattr(args, "resume", None)
    try:
        if resume:
            config_path, overrides = resume_config(resume, args.config, overrides)
        else:
            config_path = args.config
        cfg = load_config(config_path, overrides)
    except CONFIG_ERRORS as err:
        return refuse("relayrl", err)
    if args.command == "config":
        print(dump_config(cfg))
        return 0
    if args.command == "plan":
        return plan_command(cfg, args.node)
    if args.dry_run:
        from cli.dry_run import dry_run

        checks, report = dry_run(cfg, args.node)
        print(report)
        return 2 if any(c.status == "error" for c in checks) else 0
    if args.node:
        print("relayrl: --node plans offline and goes with --dry-run (or `relayrl plan`)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.checkpoint import CheckpointError
    from cluster.placement import PlacementError
    from cluster.trainer import train

    try:
        summary = train(cfg, resume)
    except PlacementError as err:
        return refuse_placement("relayrl", err)
    except CheckpointError as err:
        return refuse("relayrl", err)
    brief = {k: summary[k] for k in ("accuracy_before", "accuracy_after", "steps", "wall_seconds", "final_model")}
    print(json.dumps(brief, indent=2))
    return 0


def worker_count(text: str) -> int:
    """argparse type of --rollout-workers: a whole number (its range is request_scale's to check)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of workers: give an integer >= 1, "
                                         "e.g. --rollout-workers 2") from None


def scale_command(run_dir: str, rollout_workers: int, wait_s: float) -> int:
    """Write the request (cluster/scale_requests.py); with `wait_s`, print the driver's record of it. Exit 0 once
    applied (or at once with --wait 0), 1 if the job refused it or did not answer in time, 2 on a bad argument or
    a folder where no job runs (no fresh heartbeat of its driver: `check_running`)."""
    from cluster.scale_requests import request_scale, wait_done

    try:
        request_id = request_scale(run_dir, rollout_workers)
    except ValueError as err:
        return refuse("relayrl scale", err)
    if wait_s <= 0:
        print(json.dumps({"id": request_id, "rollout": rollout_workers, "status": "requested"}))
        return 0
    try:
        done = wait_done(run_dir, request_id, wait_s)
    except ValueError as err:  # the driver stopped while we waited
        return refuse("relayrl scale", f"request {request_id} not applied: {err}", 1)
    if done is None:
        return refuse("relayrl scale", f"request {request_id} not applied within --wait {wait_s:g} s: the job "
                                       f"writing {run_dir} applies requests between two steps, and a step may take "
                                       "longer; the request stays, and is applied at the next step boundary. Raise "
                                       "--wait to see its result", 1)
    print(json.dumps(done))
    return 1 if "error" in done else 0


def resume_config(run_dir: str, config: str | None, overrides: list[str]) -> tuple[str, list[str]]:
    """(config file, overrides) of a resumed run: --config or the run's own config.yaml, and output_dir=RUN_DIR
    (an --output-dir or output_dir override naming another folder is refused)."""
    from pathlib import Path

    from cluster.checkpoint import find_resume_checkpoint

    find_resume_checkpoint(run_dir)  # no complete checkpoint: say so before anything starts
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "output_dir" and Path(value.strip()).resolve() != Path(run_dir).resolve():
            raise ValueError(f"--resume {run_dir} continues the run in that folder; output_dir={value.strip()} "
                             "names another one. Drop --output-dir/output_dir, or start a new run without --resume")
    if config is None:
        config = str(Path(run_dir) / "config.yaml")
        if not Path(config).is_file():
            raise FileNotFoundError(f"--resume {run_dir}: no config.yaml there (every run writes one); is this the "
                                    "output_dir of a run? Give --config FILE to resume with an explicit config")
    return config, [*overrides, f"output_dir={run_dir}"]


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="greedy accuracy, pass@1 and pass@k of a model folder on a held-out set, "
                                    "with a JSONL of every generation (vLLM + the reward workers)")
    p.add_argument("--model", required=True,
                   help="Hugging Face model folder, e.g. runs/demo/final_model; `demo` is the cached warm-started "
                        "demo model before RL")
    p.add_argument("--data", required=True, metavar="NAME_OR_FILE",
                   help="demo (arithmetic), gsm8k (the shared GSM8K test file), or a JSONL/Parquet file")
    p.add_argument("--samples", type=int, default=8, metavar="K",
                   help="sampled responses per prompt (at train.eval_temperature, default 0.6, and "
                        "train.eval_top_p, default 0.95) for pass@k, k = 1, 2, 4, ... K; "
                        "0 reports greedy accuracy only (default 8)")
    p.add_argument("--field", action="append", default=[], metavar="KEY=COLUMN",
                   help="map a file's columns: prompt=COLUMN, answer=COLUMN, tests=COLUMN (repeatable)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts evaluated (data.num_eval_prompts)")
    p.add_argument("--config", default=None, help="YAML run config for the settings (rollout, reward, data)")
    p.add_argument("--output-dir", default="runs/eval", help="writes generations.jsonl and summary.json here")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. reward.verifier=math train.eval_temperature=1.0")


def eval_command(args) -> int:
    """Exit 2 on bad input (named path, line and field), 3 when the placement is refused."""
    from cluster.evaluation import EvalInputError, parse_fields

    overrides = list(args.overrides)
    if args.num_prompts is not None:
        overrides.append(f"data.num_eval_prompts={args.num_prompts}")
    if args.samples < 0:
        print(f"relayrl eval: --samples={args.samples} must be 0 (greedy only) or more", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, overrides)
        fields = parse_fields(args.field)
    except CONFIG_ERRORS as err:
        return refuse("relayrl eval", err)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.evaluation import run_eval
    from cluster.placement import PlacementError

    try:
        summary = run_eval(cfg, args.model, args.data, args.samples, fields if args.field else None, args.output_dir)
    except EvalInputError as err:
        return refuse("relayrl eval", err)
    except PlacementError as err:
        return refuse_placement("relayrl eval", err)
    print(json.dumps(summary, indent=2))
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


def plot_command(run_dir: str, out_dir: str | None) -> int:
    """Write the run's figures and list them; exit 2 when the folder holds nothing to plot."""
    from cli.plots import PlotError, plot_run

    try:
        paths = plot_run(run_dir, out_dir)
    except PlotError as err:
        print(f"relayrl plot: {err}", file=sys.stderr)
        return 2
    print("\n".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
