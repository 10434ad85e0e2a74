"""`relayrl plot RUN_DIR` and the end-of-run figures: PNGs from metrics.jsonl, and a clear error without it."""

import json
import struct
from pathlib import Path

import pytest

from cli.main import main
from cli.plots import FIGURES, PlotError, load_metrics, phase_shares, plot_run, smooth

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIXTURE_RUN = Path(__file__).parent / "fixtures" / "demo_run"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def write_run(folder: Path, steps: int = 40) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(1, steps + 1):
        rows.append({
            "step": step, "reward/mean": step / steps, "reward/accuracy": step / steps,
            "response/length_mean": 3.0, "response/truncated_frac": 0.0,
            "is_weight_mean": 1.0, "is_weight_max": 1.5, "is_ess": 0.99, "clip_frac": 0.01,
            # lag 0 on even steps only, lag 1 on odd steps only
            **({"staleness/hist_0": 1.0} if step % 2 == 0 else {"staleness/hist_1": 1.0}),
            "time/wait_s": 1.0, "time/learner_s": 2.0, "time/publish_s": 0.5, "time/step_s": 4.0,
            "learner/tokens_per_s": 1000.0, **({"eval/accuracy": 0.5} if step == steps // 2 else {}),
        })
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(json.dumps({"accuracy_before": 0.4, "accuracy_after": 0.6, "steps": steps}))
    return folder


def test_every_figure_is_a_nonempty_png(tmp_path):
    paths = plot_run(write_run(tmp_path / "run"))
    assert [p.name for p in paths] == ["overview.png", *(f"{name}.png" for name in FIGURES)]
    for path in paths:
        assert path.parent == tmp_path / "run" / "plots"
        width, height = png_size(path)
        assert width > 300 and height > 200 and path.stat().st_size > 5000


def test_phase_shares_divide_summed_step_time():
    # two steps of 4 s = 8 s: learner 2+2 = 0.5, wait 1+1 = 0.25, publish 0.5+0.5 = 0.125, and the
    # remaining 8 - 7 = 1 s is `other` = 0.125
    rows = [{"time/wait_s": 1.0, "time/learner_s": 2.0, "time/publish_s": 0.5, "time/step_s": 4.0}] * 2
    assert phase_shares(rows) == {"learner": 0.5, "wait": 0.25, "publish": 0.125, "other": 0.125}


def test_smooth_is_a_trailing_mean():
    # window 2: [1, (1+3)/2, (3+5)/2]
    assert smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_folder_without_metrics_says_what_it_must_contain(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("train: {steps: 1}\n")
    with pytest.raises(PlotError, match="has no metrics.jsonl; a run folder to plot must contain metrics.jsonl"):
        plot_run(tmp_path)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "metrics.jsonl" in err and "summary.json" in err and str(tmp_path) in err
    assert not (tmp_path / "plots").exists()


def test_broken_line_is_named_but_an_unfinished_last_line_is_skipped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    rows, summary = load_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1] and summary == {}
    (tmp_path / "metrics.jsonl").write_text('{"step": 1\n{"step": 2, "reward/mean": 0.5}\n')
    with pytest.raises(PlotError, match=r"metrics.jsonl:1: not valid JSON"):
        load_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(PlotError, match="holds no metrics yet"):
        load_metrics(tmp_path)


def test_cli_plots_a_real_demo_run_folder(tmp_path, capsys):
    # metrics.jsonl and summary.json of a real `relayrl train` demo run (its first 40 steps), as the trainer wrote them
    assert main(["plot", str(FIXTURE_RUN), "--out", str(tmp_path / "figs")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "figs" / f"{name}.png") for name in ["overview", *FIGURES]]
    for path in map(Path, printed):
        width, height = png_size(path)
        assert width > 300 and height > 200


def test_a_run_with_tools_gets_the_tool_figures(tmp_path):
    run = write_run(tmp_path / "run", steps=10)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        row.update({"tools/calls_per_sample": 0.5, "tools/turns_per_sample": 1.5, "tools/call_rate": 0.4,
                    "tools/token_share": 0.2, "tools/max_turns_share": 0.0, "tools/errors_timeout": 1.0,
                    "tools/errors_exception": 0.0, "tools/truncated_outputs": 2.0, "tools/malformed_calls": 1.0,
                    "tools/seconds_mean": 0.3})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "tools": {"tools/calls_per_sample": 0.5,
                                                                       "tools/call_rate": 0.4}}))
    paths = plot_run(run)
    assert [p.name for p in paths] == ["overview.png", *(f"{n}.png" for n in FIGURES), "tools.png", "tool_errors.png"]
    # the overview grows a third row of panels
    assert png_size(paths[0])[1] > png_size(plot_run(write_run(tmp_path / "plain", steps=10))[0])[1]
    for path in paths:
        assert path.stat().st_size > 5000


def test_a_resized_run_gets_the_rollout_pool_figure_with_its_sizes_and_decisions(tmp_path):
    from matplotlib.figure import Figure

    from cli.plots import load_metrics, panel_pool

    run = write_run(tmp_path / "run", steps=6)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # steps 1-6: the autoscaler grows 1 -> 2 at step 2 and 2 -> 3 at step 4, shrinks to 2 at step 6; one new worker
    # failed to start at step 4 (a running total)
    sizes, changes = [1, 2, 2, 3, 3, 2], [0, 1, 0, 1, 0, -1]
    for row, size, change in zip(rows, sizes, changes):
        row.update({"rollout/num_workers": float(size), "autoscale/size": float(size),
                    "autoscale/change": float(change), "autoscale/wait_frac": 0.2,
                    "fault/start_failures_rollout": float(row["step"] >= 4)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = plot_run(run)
    assert paths[-1].name == "rollout_pool.png" and png_size(paths[-1])[0] > 300
    ax = Figure().subplots()
    assert panel_pool(ax, *load_metrics(run))
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines["rollout/num_workers"] == ([1, 2, 3, 4, 5, 6], sizes)
    assert lines["autoscaler grew"] == ([2, 4], [2, 3]) and lines["autoscaler shrank"] == ([6], [2])
    assert lines["start failures (total)"][1] == [0, 0, 0, 1, 1, 1]
    # a run at one size without the autoscaler draws no pool figure
    assert "rollout_pool.png" not in [p.name for p in plot_run(write_run(tmp_path / "fixed", steps=6))]
