"""Figures of a run folder: PNGs drawn from `metrics.jsonl` (and `summary.json` when present) with matplotlib.

`plot_run(RUN_DIR)` writes `RUN_DIR/plots/*.png`: one figure per topic and `overview.png` with every panel (the
tool panels only for a run that logged `tools/*`, the rollout pool's only for a run whose pool was resized or
autoscaled).
Called by `relayrl plot RUN_DIR` and once at the end of every run (Trainer.run). The learner's bare metric names
(`is_weight_mean`) also match a prefixed key (`learner/is_weight_mean`).
"""

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

log = logging.getLogger(__name__)

RUN_FOLDER_CONTENTS = ("metrics.jsonl (one JSON object per logged step, with a `step` field, as `relayrl train` "
                       "writes it); summary.json (held-out accuracy before and after) is used when present")


class PlotError(ValueError):
    """A folder or metrics file that cannot be plotted; the message names the path and what it must contain."""


def load_metrics(run_dir: str | Path) -> tuple[list[dict], dict]:
    """(rows of metrics.jsonl in step order, summary.json or {}). An unfinished last line (a run still writing)
    is skipped; a broken line elsewhere is an error naming the line."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise PlotError(f"{folder} is not a folder; give a run folder holding {RUN_FOLDER_CONTENTS}")
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{folder} has no metrics.jsonl; a run folder to plot must contain {RUN_FOLDER_CONTENTS}")
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                log.warning("%s:%d: unfinished last line skipped (%s)", path, number, err.msg)
                continue
            raise PlotError(f"{path}:{number}: not valid JSON ({err.msg}); every line must be one JSON object") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)):
            raise PlotError(f"{path}:{number}: each line must be a JSON object with a numeric `step` field")
        rows.append(row)
    if not rows:
        raise PlotError(f"{path} holds no metrics yet; it must contain one JSON object per logged step")
    rows.sort(key=lambda r: r["step"])
    summary_path = folder / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return rows, summary


def _key(rows: list[dict], name: str) -> str | None:
    """The logged key `name`; a bare name (`is_ess`) also matches a prefixed key (`learner/is_ess`)."""
    keys = {k for row in rows for k in row}
    if name in keys or "/" in name:
        return name if name in keys else None
    found = sorted(k for k in keys if k.rsplit("/", 1)[-1] == name)
    return found[0] if found else None


def series(rows: list[dict], name: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric, finite values only."""
    key = _key(rows, name)
    if key is None:
        return [], []
    pts = [(float(r["step"]), float(r[key])) for r in rows
           if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` points (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _lines(ax: Axes, rows: list[dict], names: list[str], ylabel: str, smoothed: bool = True) -> bool:
    """One line per metric found (raw faint, trailing mean solid); False when none was logged."""
    drawn = False
    for name in names:
        x, y = series(rows, name)
        if not x:
            continue
        window = max(1, len(x) // 25) if smoothed else 1
        if window > 1:
            line, = ax.plot(x, y, alpha=0.25, linewidth=0.8)
            ax.plot(x, smooth(y, window), color=line.get_color(), label=f"{name} (mean of {window})")
        else:
            ax.plot(x, y, marker="." if len(x) < 30 else None, label=name)
        drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    return drawn


def panel_reward(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("reward and accuracy (training batches)")
    return _lines(ax, rows, ["reward/mean", "reward/shaped_mean", "reward/accuracy"], "per sample")


def panel_heldout(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("held-out accuracy (greedy)")
    x, y = series(rows, "eval/accuracy")
    last = float(summary.get("steps") or (rows[-1]["step"] if rows else 0))
    ends = [(0.0, summary.get("accuracy_before")), (last, summary.get("accuracy_after"))]
    ends = [(s, float(a)) for s, a in ends if isinstance(a, (int, float)) and math.isfinite(a)]
    points = sorted([*zip(x, y), *ends])
    if not points:
        return False
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label="eval/accuracy")
    for (s, a), what in zip(ends, ("before", "after")):
        ax.annotate(f"{what} {a:.1%}", (s, a), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    return True


def panel_length(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("response length")
    # generated/: every finished sample, the dropped groups' too (the trained batch never holds the problems
    # the policy always fails, often the long ones)
    drawn = _lines(ax, rows, ["response/length_mean", "response/length_p50", "response/length_p99",
                              "generated/length_p99", "generated/length_max"], "tokens")
    x, y = series(rows, "response/truncated_frac")
    if x:
        twin = ax.twinx()
        twin.plot(x, smooth(y, max(1, len(x) // 25)), color="gray", linestyle="--", label="truncated share")
        twin.set_ylabel("truncated share")
        twin.set_ylim(0, 1)
        twin.legend(fontsize=7, loc="upper right")
    return drawn or bool(x)


def panel_staleness(ax: Axes, rows: list[dict], summary: dict) -> bool:
    """Share of trained samples at each lag (policy versions), averaged over the logged steps."""
    ax.set_title("staleness of trained samples")
    hist: dict[int, float] = {}
    steps = 0
    for row in rows:
        lags = {int(k.rsplit("hist_", 1)[1]): float(v) for k, v in row.items()
                if "staleness/hist_" in k and k.rsplit("hist_", 1)[1].isdigit() and isinstance(v, (int, float))}
        if lags:
            steps += 1
            for lag, share in lags.items():
                hist[lag] = hist.get(lag, 0.0) + share
    if not hist:
        return False
    lags = sorted(hist)
    shares = [hist[k] / steps for k in lags]
    ax.bar([str(k) for k in lags], shares)
    for i, s in enumerate(shares):
        ax.annotate(f"{s:.1%}", (i, s), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("lag (policy versions behind the learner)")
    ax.set_ylabel(f"share of samples (mean of {steps} steps)")
    ax.set_ylim(0, 1.1)
    return True


def panel_importance(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("importance weights and clipping")
    drawn = _lines(ax, rows, ["is_weight_mean", "is_weight_max", "is_ess", "ratio_mean", "ratio_max"], "weight")
    x, y = series(rows, "clip_frac")
    xt, yt = series(rows, "is_truncated_frac")
    if x or xt:
        twin = ax.twinx()
        for xs, ys, label, style in ((x, y, "clip_frac", "--"), (xt, yt, "is_truncated_frac", ":")):
            if xs:
                twin.plot(xs, smooth(ys, max(1, len(xs) // 25)), color="gray", linestyle=style, label=label)
        twin.set_ylim(bottom=0)
        twin.set_ylabel("share of tokens")
        twin.legend(fontsize=7, loc="upper right")
    return drawn or bool(x or xt)


def panel_throughput(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("throughput")
    return _lines(ax, rows, ["learner/tokens_per_s", "rollout/tokens_per_s"], "tokens / s")


def phase_shares(rows: list[dict]) -> dict[str, float]:
    """Share of the summed step time per phase (`time/<phase>_s` keys; `other` is the step's remainder)."""
    totals: dict[str, float] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("time/") and key.endswith("_s") and isinstance(value, (int, float)):
                totals[key[5:-2]] = totals.get(key[5:-2], 0.0) + float(value)
    step = totals.pop("step", 0.0)
    parts = sum(totals.values())
    if step > parts:
        totals["other"] = step - parts
    whole = max(step, parts)
    return {k: v / whole for k, v in sorted(totals.items(), key=lambda kv: -kv[1])} if whole > 0 else {}


def panel_phases(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("share of step time per phase")
    shares = phase_shares(rows)
    if not shares:
        return False
    names = list(shares)
    ax.barh(names, [shares[n] for n in names])
    for i, n in enumerate(names):
        ax.annotate(f"{shares[n]:.0%}", (shares[n], i), va="center", xytext=(3, 0), textcoords="offset points",
                    fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.1)
    ax.set_xlabel("share of summed step time")
    return True


def panel_tools(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("tool use (training batches)")
    drawn = _lines(ax, rows, ["tools/calls_per_sample", "tools/turns_per_sample"], "per sample")
    twin = ax.twinx()
    shares = False
    for name, style in (("tools/call_rate", "--"), ("tools/token_share", ":"), ("tools/max_turns_share", "-.")):
        x, y = series(rows, name)
        if x:
            twin.plot(x, smooth(y, max(1, len(x) // 25)), color="gray", linestyle=style, label=name)
            shares = True
    if shares:
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("share of samples / tokens")
        twin.legend(fontsize=7, loc="upper right")
    else:
        twin.remove()
    return drawn or shares


def panel_tool_errors(ax: Axes, rows: list[dict], summary: dict) -> bool:
    ax.set_title("tool errors, cut outputs, malformed calls")
    names = sorted({k for row in rows for k in row if k.startswith("tools/errors_")})
    drawn = _lines(ax, rows, [*names, "tools/truncated_outputs", "tools/malformed_calls"], "calls")
    x, y = series(rows, "tools/seconds_mean")
    if x:
        twin = ax.twinx()
        twin.plot(x, smooth(y, max(1, len(x) // 25)), color="gray", linestyle="--", label="tools/seconds_mean")
        twin.set_ylim(bottom=0)
        twin.set_ylabel("seconds per call")
        twin.legend(fontsize=7, loc="upper right")
    return drawn or bool(x)


def panel_pool(ax: Axes, rows: list[dict], summary: dict) -> bool:
    """The rollout pool's size over the run (`relayrl scale`, rollout.autoscale), the autoscaler's grow and shrink
    decisions on it, new workers that failed to start, and the share of each step the learner waited (what the
    autoscaler reads)."""
    ax.set_title("rollout pool: workers, autoscaler decisions, learner wait")
    x, y = series(rows, "rollout/num_workers")
    if x:
        ax.step(x, y, where="post", label="rollout/num_workers")
    cx, change = series(rows, "autoscale/change")
    # a decision is drawn at the size it asked for (autoscale/target; runs before it logged the size after it)
    sizes = dict(zip(*series(rows, "autoscale/target"))) or dict(zip(*series(rows, "autoscale/size")))
    for sign, marker, color, label in ((1, "^", "tab:green", "autoscaler grew"),
                                       (-1, "v", "tab:orange", "autoscaler shrank")):
        at = [s for s, c in zip(cx, change) if c * sign > 0 and s in sizes]
        if at:
            ax.plot(at, [sizes[s] for s in at], linestyle="none", marker=marker, color=color, label=label)
    fx, failed = series(rows, "fault/start_failures_rollout")
    if fx and max(failed) > 0:
        ax.plot(fx, failed, color="tab:red", linestyle=":", marker="x", label="start failures (total)")
    if ax.get_lines():
        ax.set_xlabel("step")
        ax.set_ylabel("rollout workers")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    wx, wait = series(rows, "autoscale/wait_frac")
    if wx:
        twin = ax.twinx()
        twin.plot(wx, smooth(wait, max(1, len(wx) // 25)), color="gray", linestyle="--", label="autoscale/wait_frac")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("share of the step the learner waited")
        twin.legend(fontsize=7, loc="upper right")
    return bool(x or wx)


Panel = Callable[[Axes, list[dict], dict], bool]

FIGURES: dict[str, Panel] = {
    "reward_accuracy": panel_reward,
    "heldout_accuracy": panel_heldout,
    "response_length": panel_length,
    "staleness": panel_staleness,
    "importance_weights": panel_importance,
    "throughput": panel_throughput,
    "time_per_phase": panel_phases,
}
"""One PNG per entry (file name without .png); overview.png holds every panel."""

TOOL_FIGURES: dict[str, Panel] = {"tools": panel_tools, "tool_errors": panel_tool_errors}
"""Drawn after FIGURES, only for a run that logged `tools/*` metrics (tools enabled)."""

POOL_FIGURES: dict[str, Panel] = {"rollout_pool": panel_pool}
"""Drawn after those, only for a run whose rollout pool changed size or ran the autoscaler (`elastic_run`)."""


def elastic_run(rows: list[dict]) -> bool:
    """The run ran the autoscaler (autoscale/*), or its rollout pool took more than one size."""
    return (any(k.startswith("autoscale/") for row in rows for k in row)
            or len(set(series(rows, "rollout/num_workers")[1])) > 1)


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"not logged in this run\n({what})", ha="center", va="center", transform=ax.transAxes,
            fontsize=9, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures of a run folder (default `RUN_DIR/plots/`) and return their paths, overview first."""
    rows, summary = load_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    figures = dict(FIGURES)
    if any(k.startswith("tools/") for row in rows for k in row):
        figures.update(TOOL_FIGURES)
    if elastic_run(rows):
        figures.update(POOL_FIGURES)
    grid_rows = math.ceil((len(figures) + 1) / 4)  # the panels and the summary text, four a row
    overview = Figure(figsize=(18, 4.5 * grid_rows), layout="constrained")
    axes = overview.subplots(grid_rows, 4).flatten()
    title = f"{Path(run_dir).resolve().name}: {len(rows)} logged steps"
    overview.suptitle(title)
    for ax, (name, panel) in zip(axes, figures.items()):
        if not panel(ax, rows, summary):
            _no_data(ax, name)
    for ax in axes[len(figures):-1]:
        ax.axis("off")
    _summary_text(axes[-1], rows, summary)
    written.append(_save(overview, out / "overview.png"))
    for name, panel in figures.items():
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        ax = fig.subplots()
        if not panel(ax, rows, summary):
            _no_data(ax, name)
        written.append(_save(fig, out / f"{name}.png"))
    return written


def _summary_text(ax: Axes, rows: list[dict], summary: dict) -> None:
    ax.axis("off")
    lines = [f"steps logged: {len(rows)} (last {int(rows[-1]['step'])})"]
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)):
        lines.append(f"held-out accuracy: {before:.1%} -> {after:.1%}")
    for key, label in (("wall_seconds", "job wall time"), ("train_seconds", "training time")):
        if isinstance(summary.get(key), (int, float)):
            lines.append(f"{label}: {summary[key]:.0f} s")
    tools = summary.get("tools")
    if isinstance(tools, dict) and isinstance(tools.get("tools/calls_per_sample"), (int, float)):
        lines.append(f"tool calls per sample: {tools['tools/calls_per_sample']:.2f} "
                     f"(samples with a call: {tools.get('tools/call_rate', 0.0):.1%})")
    ax.text(0.0, 1.0, "\n".join(lines), va="top", fontsize=10, family="monospace", transform=ax.transAxes)


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, format="png")
    return path


def plot_after_run(run_dir: str | Path) -> list[Path]:
    """The end-of-run call: figures are a convenience, so a failure to draw them is logged, never raised."""
    try:
        paths = plot_run(run_dir)
    except (PlotError, OSError, ValueError, RuntimeError) as err:
        log.warning("figures of %s not written: %s (retry with `relayrl plot %s`)", run_dir, err, run_dir)
        return []
    log.warning("figures written to %s", paths[0].parent)
    return paths
