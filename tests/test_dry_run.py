"""`relayrl train --config FILE --dry-run`: every check reported, nothing started, exit 2 on any error.

The shipped GPU configs name model folders that exist only on the GPU nodes (/models/...): their dry run here
must say so by name and exit 2; with a local model folder and the nodes they describe (`# plan-for:`) they pass.
"""

from pathlib import Path

import pytest
import ray

from cli.main import main
from tests.conftest import REPO, shared_dir, start_test_ray
from tests.test_configs import GPU_CONFIGS as CONFIGS  # the CPU demos describe no cluster

GSM8K = shared_dir() / "data" / "gsm8k"


def plan_for_args(path: Path) -> list[str]:
    specs = [line.split(":", 1)[1].strip() for line in path.read_text().splitlines() if line.startswith("# plan-for:")]
    return [arg for spec in specs for arg in ("--node", spec)]


@pytest.fixture(autouse=True, scope="module")
def no_ray_session():
    """A dry run checks what this machine would start, as a user's shell sees it: no Ray connected and no
    RAY_ADDRESS (the session's test Ray, started by earlier tests, sets both). Restored afterwards."""
    was_running = ray.is_initialized()
    if was_running:
        ray.shutdown()
    mp = pytest.MonkeyPatch()
    mp.delenv("RAY_ADDRESS", raising=False)
    yield
    mp.undo()
    if was_running:
        start_test_ray()


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    from tests.tiny_text_model import build_text_model

    return build_text_model(tmp_path_factory.mktemp("dry_run_model") / "model")


def test_demo_config_dry_run_is_ready_and_starts_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RELAYRL_CACHE_DIR", str(tmp_path / "cache"))
    code, out = run_cli(capsys, "train", "--dry-run", "--output-dir", str(tmp_path / "run"))
    assert code == 0, out
    for line in ("[ok] config: valid; preset dapo", "[ok] model: built-in demo model", "not built yet",
                 "[ok] data (train): built-in arithmetic task: 5000 generated problems",
                 "[ok] data (test): built-in arithmetic task: 200 generated problems",
                 "[ok] placement: fits the embedded local cluster",
                 # 500 steps x 16 prompts x 8 samples = 128 samples per step
                 "training: 500 steps x 16 prompts x 8 samples = 128 samples per step", "ready: no errors"):
        assert line in out, (line, out)
    # nothing started, nothing written: no Ray, no run folder, no demo model built
    assert not ray.is_initialized()
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_names_its_absent_model_folder(path, capsys):
    code, out = run_cli(capsys, "train", "--config", str(path), "--dry-run")
    assert code == 2, out
    assert "[error] model: model.path='/models/Qwen2.5-" in out and "does not exist on this machine" in out
    # the data rows are still parsed with the configured fields (GSM8K's own), just not tokenized
    assert out.count("first 3 rows parsed") == 2 and "prompts not tokenized" in out
    if "address: auto" in path.read_text():
        # a cluster to join is never contacted by a dry run
        assert "[not checkable here] placement: the run joins the Ray cluster at 'auto'" in out
    else:
        # the embedded cluster here has no 8 GPUs
        assert "[error] placement: refused on the embedded local cluster" in out and "GPUs; the cluster has" in out
    assert "1 error(s)" in out or "2 error(s)" in out
    assert not ray.is_initialized()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_passes_with_a_local_model_and_its_nodes(path, text_model, capsys):
    code, out = run_cli(capsys, "train", "--config", str(path), "--dry-run", *plan_for_args(path),
                        f"model.path={text_model}", f"data.train_path={GSM8K / 'train.jsonl'}",
                        f"data.test_path={GSM8K / 'test.jsonl'}")
    assert code == 0, out
    assert out.count("[ok]") == 5 and "[error]" not in out and "ready: no errors" in out
    # the first GSM8K training row's gold answer, tokenized through the chat template
    assert "first gold answer '72'; prompts of" in out
    assert "[ok] placement: fits the --node specs" in out and "node 0" in out
    assert not ray.is_initialized()


def test_bad_data_field_names_file_line_and_setting(tmp_path, text_model, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    code, out = run_cli(capsys, "train", "--dry-run", f"model.path={text_model}", "data.format=jsonl",
                        f"data.train_path={data}", f"data.test_path={data}")
    assert code == 2
    assert f"[error] data (train): {data}:1: row has no field 'question' (data.prompt_field='question')" in out


def test_critic_preset_and_missing_data_file_are_errors(tmp_path, capsys):
    # ppo without a critic fails the config's own validation, before any check runs
    code, out = run_cli(capsys, "train", "--dry-run", "algorithm.preset=ppo")
    assert code == 2 and "critic.num_workers" in out
    code, out = run_cli(capsys, "train", "--dry-run", "data.format=gsm8k",
                        f"data.train_path={tmp_path / 'absent.jsonl'}", f"data.test_path={GSM8K / 'test.jsonl'}")
    assert code == 2
    assert f"[error] data (train): data.train_path='{tmp_path / 'absent.jsonl'}'" in out


def test_node_flag_without_dry_run_is_refused(capsys):
    code, out = run_cli(capsys, "train", "--node", "GPU=8,CPU=96")
    assert code == 2 and "--dry-run" in out


def test_an_outside_only_dry_run_reads_no_data_file(tmp_path, text_model, capsys):
    # data.format=gsm8k names a file that is not there; an outside-only run never reads it
    code, out = run_cli(capsys, "train", "--dry-run", f"model.path={text_model}", "data.format=gsm8k",
                        f"data.train_path={tmp_path / 'absent.jsonl'}", "gateway.enabled=true",
                        "gateway.outside_only=true")
    assert code == 0, out
    assert "[ok] data: none loaded: gateway.outside_only=true" in out and "absent.jsonl" not in out
