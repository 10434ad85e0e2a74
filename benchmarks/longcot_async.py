"""Asynchronous against synchronous training on the long chain-of-thought demo (issue 18, item 3), in one run.

Runs `relayrl train --config deploy/configs/demo_longcot.yaml` once per mode, one after the other, each a fresh
job (its own Ray, engine and learner) with the same seed and step count, and prints from their run folders:
wall time to the same step (and the sync/async ratio), held-out accuracy before and after, the share of trained
samples whose tokens span two or more policy versions, effective over processed learner tokens, drops by reason,
and response length at the start and end of training (mean, p50, p99, truncated share). Writes the table
(`table.md`), the numbers (`results.json`) and a figure (`longcot_async.png`) into `--out`.

    python benchmarks/longcot_async.py --steps 40 --out runs/bench_longcot [--modes async,sync] [key=value ...]

Modes: `async` is the shipped config (max_staleness 9, partial rollouts); `sync` sets `train.max_staleness=0`
(generate a batch with the current weights, train, load: no overlap). `wide` keeps 32 groups in flight per worker
(256 requests for 128 engine slots) and `length_aware` adds `rollout.length_aware_dispatch` to it (the prompts'
`length_hint` first): compare those two. Extra `key=value` overrides go to every
mode. Run it on an otherwise idle machine: the two jobs run one after the other, so load that changes between
them moves the ratio.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "deploy" / "configs" / "demo_longcot.yaml"
MODES = {"async": [], "sync": ["train.max_staleness=0"],
         # length-aware dispatch needs groups waiting for engine slots: twice the groups that fill the 128 slots
         "wide": ["rollout.prompts_in_flight=32"],
         "length_aware": ["rollout.prompts_in_flight=32", "rollout.length_aware_dispatch=true"]}
"""Overrides of each mode over the shipped long-CoT config."""


def run_mode(mode: str, steps: int, out: Path, extra: list[str]) -> Path:
    """One job as a user runs it (`relayrl train`), in its own process; returns its run folder."""
    folder = out / mode
    cmd = [sys.executable, "-m", "cli.main", "train", "--config", str(CONFIG), "--output-dir", str(folder),
           f"train.steps={steps}", *MODES[mode], *extra]
    print(f"[{mode}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{mode}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True, env=os.environ.copy())
    print(f"[{mode}] done in {time.perf_counter() - t0:.0f} s (log: {out / f'{mode}.log'})", flush=True)
    return folder


def window(rows: list[dict], first: bool, n: int) -> list[dict]:
    return rows[:n] if first else rows[-n:]


def length_summary(rows: list[dict]) -> dict[str, float]:
    """Mean over the steps' own figures: mean length, p50, p99, truncated share."""
    def pick(key: str) -> float:
        return statistics.fmean(float(r[key]) for r in rows if key in r)

    return {"mean": pick("response/length_mean"), "p50": pick("response/length_p50"),
            "p99": pick("response/length_p99"), "truncated": pick("response/truncated_frac")}


def summarize(folder: Path, edge_steps: int) -> dict:
    """The figures of one run folder (metrics.jsonl and summary.json)."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["step"])
    summary = json.loads((folder / "summary.json").read_text())
    sequences = sum(r["num_sequences"] for r in rows)
    mixed = sum(r["staleness/mixed_version_frac"] * r["num_sequences"] for r in rows) / sequences
    last = rows[-1]
    drops = {k.split("dropped_", 1)[1]: int(v) for k, v in last.items() if k.startswith("queue/dropped_")}
    return {
        "steps": summary["steps"],
        "train_s": summary["train_seconds"],
        "wall_s": summary["wall_seconds"],
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "mixed_version_share": mixed,
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in rows),
        "staleness_max": max(r["staleness/max"] for r in rows),
        "effective_over_processed": (sum(r["learner/real_tokens"] for r in rows)
                                     / sum(r["learner/processed_tokens"] for r in rows)),
        "trained_samples": sequences,
        "drops": drops,
        "length_start": length_summary(window(rows, True, edge_steps)),
        "length_end": length_summary(window(rows, False, edge_steps)),
        "learner_idle": summary["phase_seconds"]["wait_s"] / summary["train_seconds"],
    }


def table(results: dict[str, dict], edge_steps: int) -> str:
    modes = list(results)
    lines = ["| | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]

    def row(name: str, fmt) -> None:
        lines.append(f"| {name} | " + " | ".join(fmt(results[m]) for m in modes) + " |")

    row("steps", lambda r: str(r["steps"]))
    row("training wall time (s)", lambda r: f"{r['train_s']:.0f}")
    row("job wall time, evaluations and start included (s)", lambda r: f"{r['wall_s']:.0f}")
    row("learner idle share", lambda r: f"{r['learner_idle']:.0%}")
    row("held-out accuracy before -> after", lambda r: f"{r['accuracy_before']:.1%} -> {r['accuracy_after']:.1%}")
    row("trained samples spanning >= 2 policy versions", lambda r: f"{r['mixed_version_share']:.1%}")
    row("staleness mean / max (versions)", lambda r: f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f}")
    row("effective / processed learner tokens", lambda r: f"{r['effective_over_processed']:.3f}")
    row("drops by reason (groups)",
        lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["drops"].items()) if v) or "none")
    for edge in ("start", "end"):
        row(f"response length, {edge} ({edge_steps} steps): mean / p50 / p99",
            lambda r, e=edge: "{mean:.0f} / {p50:.0f} / {p99:.0f}".format(**r[f"length_{e}"]))
        row(f"truncated share, {edge}", lambda r, e=edge: f"{r[f'length_{e}']['truncated']:.1%}")
    text = "\n".join(lines)
    if "sync" in results and "async" in results:
        text += (f"\n\nsync / async training wall time to {results['async']['steps']} steps: "
                 f"{results['sync']['train_s'] / results['async']['train_s']:.2f}x")
    if "wide" in results and "length_aware" in results:
        text += (f"\n\nwide / length_aware training wall time to {results['wide']['steps']} steps: "
                 f"{results['wide']['train_s'] / results['length_aware']['train_s']:.2f}x")
    return text


def figure(folders: dict[str, Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from cli.plots import load_metrics, series

    fig = Figure(figsize=(12, 3.6))
    axes = fig.subplots(1, 3)
    for mode, folder in folders.items():
        rows, summary = load_metrics(folder)
        x, y = series(rows, "time/step_s")
        elapsed = [sum(y[: i + 1]) for i in range(len(y))]
        axes[0].plot(elapsed, x, label=mode)
        for key, style in (("response/length_mean", "-"), ("response/length_p99", ":")):
            xs, ys = series(rows, key)
            axes[1].plot(xs, ys, linestyle=style, label=f"{mode} {key.split('/')[1]}")
        xs, ys = series(rows, "staleness/mixed_version_frac")
        axes[2].plot(xs, ys, label=mode)
    for ax, title, xlabel, ylabel in (
            (axes[0], "steps over training wall time", "seconds", "step"),
            (axes[1], "response length of trained samples", "step", "tokens"),
            (axes[2], "samples spanning >= 2 policy versions", "step", "share")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", default="async,sync", help=f"comma-separated, of {sorted(MODES)}")
    parser.add_argument("--out", default="runs/bench_longcot")
    parser.add_argument("--edge-steps", type=int, default=10, help="steps averaged for length at start and end")
    parser.add_argument("--report-only", action="store_true", help="re-read the run folders already in --out")
    args, extra = parser.parse_known_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes {args.modes}: unknown {unknown}; choose from {sorted(MODES)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    folders = {m: (out / m if args.report_only else run_mode(m, args.steps, out, extra)) for m in modes}
    results = {m: summarize(f, args.edge_steps) for m, f in folders.items()}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = table(results, args.edge_steps)
    (out / "table.md").write_text(text + "\n")
    figure(folders, out / "longcot_async.png")
    print(text)


if __name__ == "__main__":
    main()
