"""The report deploy/gpu_smoke.sh writes after a first GPU run: `python -m cli.gpu_report RUN_DIR [--log FILE]`
reads the run folder (metrics.jsonl, summary.json) and the run's console log, and writes RUN_DIR/gpu_smoke_report.md
(also printed). Pure Python: it runs on any machine that holds the folder.

It answers what a first run on a new GPU node must show: how vLLM started (its INFO lines), how long each weight
version took to reach the engines, the weight-sync check's largest gap against its tolerance, how old the trained
samples' tokens were, and tokens per second on both sides.
"""

import argparse
import json
import re
import sys
from pathlib import Path

REPORT_NAME = "gpu_smoke_report.md"

STARTUP_MARKERS = ("non-default args", "Initializing a V1 LLM engine", "Using max model len", "backend",
                   "Model loading took", "Loading weights took", "KV cache", "Maximum concurrency", "CUDA graph",
                   "Graph capturing", "torch.compile", "async scheduling", "Asynchronous scheduling",
                   "init engine", "tensor_parallel_size", "Chunked prefill")
"""Substrings of the vLLM INFO lines worth reading after a first start: the engine arguments vLLM saw, the
attention backend, load time, KV cache size and concurrency, CUDA graphs and compilation, async scheduling."""

MAX_STARTUP_LINES = 80
VLLM_INFO = re.compile(r"\bINFO\b.*\[[\w./-]+\.py:\d+\]")
"""vLLM's log format: `INFO 12-07 05:30:00 [gpu_model_runner.py:1234] message` (Ray prefixes the actor)."""


def startup_lines(log_text: str) -> list[str]:
    """The vLLM INFO lines of `log_text` that carry a STARTUP_MARKERS substring, in order, at most
    MAX_STARTUP_LINES."""
    lines = [line.rstrip() for line in log_text.splitlines()
             if VLLM_INFO.search(line) and any(marker in line for marker in STARTUP_MARKERS)]
    return lines[:MAX_STARTUP_LINES]


def read_run(run_dir: Path) -> tuple[list[dict], dict]:
    """(metrics.jsonl rows, summary.json) of a run folder; the summary is {} while the run has not finished."""
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{run_dir} holds no metrics.jsonl: pass the run folder (output_dir) of a "
                                "`relayrl train` run that logged at least one step")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    summary_path = run_dir / "summary.json"
    return rows, (json.loads(summary_path.read_text()) if summary_path.is_file() else {})


def seconds_per_version(rows: list[dict], summary: dict) -> dict[str, float]:
    """Per rollout worker, its total load time over the versions it loaded (versions_seen, less the start's);
    and the learner's publish time per step."""
    out = {}
    for i, worker in enumerate(summary.get("rollout", [])):
        loads = len(worker["versions_seen"]) - 1 if "versions_seen" in worker else worker.get("version", 0)
        if loads > 0 and "sync_s" in worker:
            out[f"rollout worker {i}: load (s per version, {loads} versions)"] = worker["sync_s"] / loads
    publish = [row["time/publish_s"] for row in rows if "time/publish_s" in row]
    if publish:
        out[f"learner: publish (s per step, mean of {len(publish)})"] = sum(publish) / len(publish)
    return out


def sync_check(rows: list[dict], summary: dict) -> dict | None:
    """{checks, max_gap, tolerance} of the weight-sync check: the summary's, else the largest logged gap. None if
    the run checked no version (weight_sync.verify_every=0)."""
    if "weight_sync_check" in summary:
        return summary["weight_sync_check"]
    gaps = [row["weights/verify_max_gap"] for row in rows if "weights/verify_max_gap" in row]
    checks = max((row.get("weights/verify_checks", 0) for row in rows), default=0)
    return {"checks": int(checks), "max_gap": max(gaps), "tolerance": None} if gaps else None


def staleness_histogram(rows: list[dict]) -> tuple[dict[int, float], float | None]:
    """Over the whole run, the share of trained samples whose oldest token was sampled `lag` versions before the
    step that trained it (staleness/hist_<lag>, weighted by each step's num_sequences), and the share of samples
    whose tokens span several versions."""
    weights, mixed, total = {}, 0.0, 0.0
    for row in rows:
        n = row.get("num_sequences", 1.0)
        lags = {int(k.rsplit("_", 1)[1]): v for k, v in row.items() if k.startswith("staleness/hist_")}
        if not lags:
            continue
        total += n
        for lag, share in lags.items():
            weights[lag] = weights.get(lag, 0.0) + share * n
        mixed += row.get("staleness/mixed_version_frac", 0.0) * n
    if not total:
        return {}, None
    return {lag: w / total for lag, w in sorted(weights.items())}, mixed / total


def tokens_per_second(rows: list[dict], summary: dict) -> dict[str, float]:
    out = {}
    workers = summary.get("rollout", [])
    if workers:
        tokens = sum(w.get("tokens", 0) for w in workers)
        wall = max(w.get("wall_s", 0.0) for w in workers)
        generate = sum(w.get("generate_s", 0.0) for w in workers)
        if wall:
            out[f"rollout, all {len(workers)} workers (tokens / wall s)"] = tokens / wall
        if generate:
            out["rollout, per worker while generating (tokens / generate s)"] = tokens / generate
    for key, label in (("rollout/tokens_per_s", "rollout (metrics, mean per step)"),
                       ("learner/tokens_per_s", "learner (metrics, mean per step)")):
        values = [row[key] for row in rows if key in row]
        if values:
            out[label] = sum(values) / len(values)
    return out


def report(run_dir: Path, log: Path | None = None) -> str:
    rows, summary = read_run(run_dir)
    lines = [f"# GPU smoke report: {run_dir}", "",
             f"{len(rows)} logged steps; summary.json {'present' if summary else 'absent (run unfinished?)'}.", ""]
    lines += ["## vLLM startup (INFO lines)", ""]
    if log is None or not log.is_file():
        lines.append(f"no console log{f' at {log}' if log else ''}: run deploy/gpu_smoke.sh, which keeps one")
    else:
        found = startup_lines(log.read_text(errors="replace"))
        lines += ["```", *found, "```"] if found else [f"no vLLM INFO startup line in {log} (VLLM_LOGGING_LEVEL "
                                                        "was not INFO?)"]
    lines += ["", "## Seconds per weight version", ""]
    lines += [f"- {k}: {v:.3f}" for k, v in seconds_per_version(rows, summary).items()] or ["- not recorded"]
    lines += ["", "## Weight-sync check", ""]
    check = sync_check(rows, summary)
    if check is None:
        lines.append("- no version was checked (weight_sync.verify_every=0, or the run ended before a check)")
    else:
        tolerance = check.get("tolerance")
        lines.append(f"- {check['checks']} checks, largest |engine - learner| log-prob gap {check['max_gap']:.4g} "
                     f"nats" + (f" (tolerance {tolerance:g}: {check['max_gap'] / tolerance:.1%} of it)"
                                if tolerance else ""))
    lines += ["", "## Token versions of the trained samples", ""]
    hist, mixed = staleness_histogram(rows)
    if hist:
        lines += ["| oldest token, versions behind | share of samples |", "| ---: | ---: |"]
        lines += [f"| {lag} | {share:.3f} |" for lag, share in hist.items()]
        lines += ["", f"- samples whose tokens span several versions: {mixed:.3f}"]
    else:
        lines.append("- not recorded (no staleness/hist_* in metrics.jsonl)")
    lines += ["", "## Tokens per second", ""]
    lines += [f"- {k}: {v:,.0f}" for k, v in tokens_per_second(rows, summary).items()] or ["- not recorded"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.gpu_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--log", type=Path, default=None, help="the run's console log (vLLM's INFO lines)")
    args = parser.parse_args(argv)
    try:
        text = report(args.run_dir, args.log)
    except FileNotFoundError as err:
        print(f"python -m cli.gpu_report: {err}", file=sys.stderr)
        return 2
    (args.run_dir / REPORT_NAME).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
