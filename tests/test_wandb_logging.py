"""`logging.wandb: true` beside TensorBoard: an offline W&B run (no network) written with the resolved config."""

import json
import time

from cluster.run_folder import RunFolder
from protocols.config import load_config


def read_record_log(run_dir, timeout_s: float = 60.0) -> bytes:
    """The offline run's record log once it holds the metrics: W&B's service process writes it and can still be
    writing after `finish()` returns on a loaded machine (CI once read the 7-byte header alone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        data = next(run_dir.glob("run-*.wandb")).read_bytes()
        if b"reward/mean" in data or time.monotonic() > deadline:
            return data
        time.sleep(0.5)


def test_offline_wandb_run_holds_the_resolved_config_and_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_root"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, [f"output_dir={tmp_path / 'run'}", "logging.wandb=true", "learner.lr=3e-5",
                             "logging.wandb_project=relayrl-test"])
    folder = RunFolder(cfg)
    folder.log(1, {"reward/mean": 0.25, "policy_version": 1})
    folder.log(2, {"reward/mean": 0.5, "policy_version": 2})
    folder.write_summary({"accuracy_before": 0.4, "accuracy_after": 0.6, "steps": 2})
    folder.close()
    runs = list((tmp_path / "wandb_root" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((tmp_path / "wandb_root").rglob("*"))
    # the resolved config (every default written out) is attached: as the run's config (in the run's record
    # log) and as the YAML file `relayrl train --config` reads, with the overrides applied
    attached = load_config(runs[0] / "files" / "relayrl_config.yaml")
    assert attached == cfg and attached.learner.lr == 3e-5
    record_log = read_record_log(runs[0])
    assert b'"samples_per_prompt":8' in record_log.replace(b" ", b"") and b"relayrl-test" in record_log
    # the metrics went to the offline run's log too, and metrics.jsonl is as without W&B
    assert b"reward/mean" in record_log
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/mean"] for r in rows] == [0.25, 0.5]


def test_wandb_is_off_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_root"))
    folder = RunFolder(load_config(None, [f"output_dir={tmp_path / 'run'}"]))
    folder.log(1, {"reward/mean": 1.0})
    folder.close()
    assert not (tmp_path / "wandb_root").exists() and not (tmp_path / "run" / "wandb").exists()
