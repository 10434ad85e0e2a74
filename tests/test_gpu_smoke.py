"""deploy/gpu_smoke.sh parses, runs the 1.5B config for 20 steps with vLLM's INFO lines and reports; its report
(cli/gpu_report.py) reads a run folder that a real CPU run wrote (tests/fixtures/demo_run) and a console log."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from cli import gpu_report
from cluster.ray_setup import QUIET_ENV, driver_log_level

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "deploy/gpu_smoke.sh"
DEMO_RUN = REPO / "tests/fixtures/demo_run"


def test_the_script_parses_and_runs_what_docs_gpu_md_says():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "deploy/configs/qwen2.5-1.5b_1node.yaml" in text and "train.steps=20" in text
    assert "VLLM_LOGGING_LEVEL=INFO" in text and "weight_sync.verify_every=1" in text
    assert '-m cli.gpu_report "$RUN_DIR" --log "$RUN_DIR/smoke.log"' in text
    assert "deploy/gpu_smoke.sh" in (REPO / "docs/gpu.md").read_text()


def test_the_script_refuses_a_venv_whose_torch_has_no_cuda(tmp_path):
    # this machine's venv is the CPU stack: the script stops before anything starts, naming the fix
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path), str(tmp_path / "run")], capture_output=True, text=True)
    assert done.returncode == 2
    assert "torch cannot use CUDA (torch.version.cuda: None" in done.stderr
    assert "RELAYRL_DEVICE=gpu make install" in done.stderr
    assert not (tmp_path / "run").exists()


def test_the_driver_vllm_log_level_reaches_the_actors(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    assert {**QUIET_ENV, **driver_log_level()}["VLLM_LOGGING_LEVEL"] == "ERROR"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    assert {**QUIET_ENV, **driver_log_level()}["VLLM_LOGGING_LEVEL"] == "INFO"


def test_report_of_a_real_cpu_run_folder(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(DEMO_RUN, run)
    summary = json.loads((run / "summary.json").read_text())
    worker = summary["rollout"][0]
    assert gpu_report.main([str(run)]) == 0
    text = (run / gpu_report.REPORT_NAME).read_text()
    loads = len(worker["versions_seen"]) - 1
    assert f"rollout worker 0: load (s per version, {loads} versions): {worker['sync_s'] / loads:.3f}" in text
    assert f"rollout, all 1 workers (tokens / wall s): {worker['tokens'] / worker['wall_s']:,.0f}" in text
    assert "no console log" in text
    assert "no version was checked" in text  # the demo run predates the check's summary entry

    rows, _ = gpu_report.read_run(run)
    hist, mixed = gpu_report.staleness_histogram(rows)
    assert set(hist) == {0, 1} and sum(hist.values()) == pytest.approx(1.0)
    assert 0.0 <= mixed <= 1.0
    assert f"| 1 | {hist[1]:.3f} |" in text


def test_report_reads_the_sync_check_and_the_vllm_startup_lines(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(DEMO_RUN, run)
    summary = json.loads((run / "summary.json").read_text())
    summary["weight_sync_check"] = {"checks": 20, "max_gap": 0.031, "tolerance": 0.5}
    (run / "summary.json").write_text(json.dumps(summary))
    log = run / "smoke.log"
    log.write_text(
        "(RolloutWorker pid=811) INFO 12-07 05:30:01 [arg_utils.py:1100] non-default args: {'model': '/m'}\n"
        "(RolloutWorker pid=811) INFO 12-07 05:30:09 [gpu_model_runner.py:2400] Model loading took 3.1 GiB\n"
        "(RolloutWorker pid=811) INFO 12-07 05:30:12 [kv_cache_utils.py:900] GPU KV cache size: 1,200,000 tokens\n"
        "(RolloutWorker pid=811) INFO 12-07 05:30:13 [core.py:100] a line a first run need not read\n"
        "step 1: the trainer's progress, not vLLM's: KV cache\n")
    text = gpu_report.report(run, log)
    assert "20 checks, largest |engine - learner| log-prob gap 0.031 nats (tolerance 0.5: 6.2% of it)" in text
    startup = gpu_report.startup_lines(log.read_text())
    assert [line.split("] ")[1] for line in startup] == [
        "non-default args: {'model': '/m'}", "Model loading took 3.1 GiB", "GPU KV cache size: 1,200,000 tokens"]
    assert all(line in text for line in startup)


def test_report_of_a_folder_without_metrics_is_refused(tmp_path, capsys):
    assert gpu_report.main([str(tmp_path)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err
