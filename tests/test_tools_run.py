"""A short training run with a tool enabled writes the `tools/*` metrics each logged step and their totals in the
summary; a run without tools writes none (tests/test_metrics.py covers that run's other metrics)."""

import json

import pytest


@pytest.mark.slow
def test_short_run_with_a_tool_logs_tool_metrics(ray_cluster, tmp_path):
    from cluster.trainer import Trainer
    from protocols.config import load_config

    # The demo's addition task with the calculator offered: the untrained demo model cannot write a call's tags,
    # so every sample is one turn with no call; the metrics are there all the same.
    cfg = load_config(None, [
        f"output_dir={tmp_path}", "train.steps=2", "learner.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "data.num_eval_prompts=4", "train.max_staleness=0", "tools.builtin=[calculator]",
        "weight_sync.verify_every=0"])
    trainer = Trainer(cfg)
    try:
        summary = trainer.run()
    finally:
        trainer.shutdown()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["tools/turns_per_sample"] == 1.0 + row["tools/calls_per_sample"]
        assert 0 <= row["tools/call_rate"] <= 1 and 0 <= row["tools/token_share"] < 1
        assert {"tools/errors_unknown_tool", "tools/errors_exception", "tools/errors_timeout",
                "tools/truncated_outputs", "tools/malformed_calls", "tools/max_turns_share"} <= set(row)
    assert set(summary["tools"]) == {k for k in rows[0] if k.startswith("tools/")}
    assert (tmp_path / "plots" / "tools.png").is_file()
