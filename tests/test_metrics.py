"""Metrics in one place (protocols/metrics.py): the merge rule, the names, the log record; and in a real short
run with a tool offered, the reward workers' counters, the evaluation sets and the tools/* metrics reaching
metrics.jsonl and the summary."""

import json
import math

import pytest

from protocols.metrics import (SECTIONS, combine_metrics, eval_metrics, gateway_metrics, log_record,
                               reference_worker_metrics, reward_worker_metrics, rollout_metrics, scalars,
                               unknown_names)


def test_merge_adds_sums_and_takes_the_max_of_max_keys():
    # loss 0.5 + 0.25 = 0.75; ratio_max max(1.5, 2.0) = 2.0; num_tokens 3 + 4 = 7; a key in one part only is kept
    parts = [{"loss": 0.5, "ratio_max": 1.5, "num_tokens": 3.0},
             {"loss": 0.25, "ratio_max": 2.0, "num_tokens": 4.0, "learner/peak_gib_max": 1.0}]
    assert combine_metrics(parts) == {"loss": 0.75, "ratio_max": 2.0, "num_tokens": 7.0, "learner/peak_gib_max": 1.0}
    assert combine_metrics([]) == {}


def test_learner_objective_uses_the_same_merge_rule():
    from learner.objective import combine_metrics as learner_combine

    assert learner_combine is combine_metrics


def test_reward_worker_metrics_weight_means_by_samples():
    # worker A: 4 samples, 2 s of checks, reward sum 3, 3 correct, 1 timeout; worker B: 1 sample, 0.5 s, 0, 0,
    # 1 exception. Merged: 5 samples, 2.5 s / 5 = 0.5 s per sample, reward 3 / 5 = 0.6, correct 0.6
    a = {"samples": 4.0, "verify_time_s": 2.0, "reward_sum": 3.0, "correct": 3.0, "error_timeout": 1.0}
    b = {"samples": 1.0, "verify_time_s": 0.5, "reward_sum": 0.0, "correct": 0.0, "error_exception": 1.0,
         "restarts": 1.0}
    m = reward_worker_metrics([a, b])
    assert m["reward_worker/samples"] == 5
    assert m["reward_worker/seconds_per_sample"] == pytest.approx(0.5)
    assert m["reward_worker/reward_mean"] == pytest.approx(0.6)
    assert m["reward_worker/correct_rate"] == pytest.approx(0.6)
    assert (m["reward_worker/error_timeout"], m["reward_worker/error_exception"], m["reward_worker/error_crash"]) \
        == (1, 1, 0)
    assert m["reward_worker/process_restarts"] == 1
    # nothing scored: every name present, zeros (no division by zero)
    empty = reward_worker_metrics([])
    assert set(empty) == set(m) and all(v == 0 for v in empty.values())


def test_reward_worker_names_never_collide_with_the_trained_batch():
    # the trainer's reward/mean (raw) and reward/shaped_mean stay its own; the scorer's are reward_worker/*
    m = reward_worker_metrics([{"samples": 1.0, "reward_sum": 1.0, "error_odd": 2.0}])
    assert not any(k.startswith("reward/") for k in m)
    assert m["reward_worker/error_odd"] == 2  # a kind outside the fixed three is reported as it occurs


def test_rollout_metrics_sum_over_workers():
    # idle (1 + 3) / wall (10 + 10) = 0.2; tokens (100 + 300) / generate (2 + 2) = 100 per s; sync 0.5 + 0.25
    reports = [{"wall_s": 10.0, "generate_s": 2.0, "idle_s": 1.0, "tokens": 100, "sync_s": 0.5, "groups": 3},
               {"wall_s": 10.0, "generate_s": 2.0, "idle_s": 3.0, "tokens": 300, "sync_s": 0.25, "groups": 1}]
    assert rollout_metrics(reports) == {"rollout/idle_frac": 0.2, "rollout/tokens_per_s": 100.0,
                                        "rollout/sync_s_total": 0.75}
    assert rollout_metrics([]) == {}


def test_gateway_metrics_sum_the_endpoints_counters_over_workers():
    # calls (5 + 3) / sessions (2 + 2) = 2 per session; samples (3 + 1) / rewarded (2 + 1) = 4/3 per rewarded one
    reports = [{"tokens": 10, "gateway": {"sessions": 2, "sessions_rewarded": 2, "calls": 5, "samples": 3,
                                          "splits_history_edited": 1}},
               {"tokens": 20, "gateway": {"sessions": 2, "sessions_rewarded": 1, "calls": 3, "samples": 1,
                                          "splits_history_edited": 0}},
               {"tokens": 30}]  # a worker without an endpoint (none in one run; the sum must not need it)
    out = gateway_metrics(reports)
    assert out["gateway/calls"] == 8.0 and out["gateway/splits_history_edited"] == 1.0
    assert out["gateway/calls_per_session"] == 2.0
    assert out["gateway/samples_per_rewarded_session"] == pytest.approx(4 / 3)
    assert unknown_names(out) == []
    assert gateway_metrics([{"tokens": 1}]) == {}


def test_reference_worker_metrics_by_hand():
    # two workers: 3 groups (600 tokens) in 1.5 s and 1 group (200 tokens) in 0.5 s
    # seconds_per_group = (1.5 + 0.5) / 4 = 0.5; tokens_per_s = 800 / 2.0 = 400
    got = reference_worker_metrics([
        {"groups": 3, "samples": 24, "tokens": 600, "micro_batches": 3, "seconds": 1.5},
        {"groups": 1, "samples": 8, "tokens": 200, "micro_batches": 2, "seconds": 0.5}])
    assert got == {"reference_worker/groups": 4, "reference_worker/samples": 32, "reference_worker/micro_batches": 5,
                   "reference_worker/seconds_per_group": 0.5, "reference_worker/tokens_per_s": 400.0}
    assert unknown_names(got) == []
    # nothing scored yet: zeros, not a division by zero
    assert reference_worker_metrics([])["reference_worker/tokens_per_s"] == 0.0


def test_eval_metrics_names():
    result = {"greedy_accuracy": 0.5, "prompts": 10, "pass_at_k": {1: 0.4, 2: 0.7}, "errors": {"timeout": 1}}
    assert eval_metrics("gsm8k", result) == {
        "eval/gsm8k/accuracy": 0.5, "eval/gsm8k/samples": 10, "eval/gsm8k/pass@1": 0.4, "eval/gsm8k/pass@2": 0.7,
        "eval/gsm8k/error_timeout": 1}


def test_names_belong_to_documented_sections():
    assert unknown_names(["reward/mean", "reward_worker/samples", "loss", "eval/demo/pass@4", "policy_version"]) == []
    assert unknown_names(["rewrd/mean", "loss"]) == ["rewrd/mean"]
    assert all(section.endswith("/") for section in SECTIONS)


def test_log_record_and_tensorboard_scalars():
    line = log_record(3, {"reward/mean": 1, "eval/accuracy": float("nan"), "flag": True})
    row = json.loads(line)
    assert list(row) == ["step", "reward/mean", "eval/accuracy", "flag"]
    assert row["step"] == 3 and row["reward/mean"] == 1.0 and math.isnan(row["eval/accuracy"])
    # TensorBoard gets the finite numbers only
    assert scalars({"a": 1, "b": float("inf"), "c": "text", "d": 0.5}) == {"a": 1.0, "d": 0.5}


def test_run_folder_writes_through_the_module(tmp_path):
    from cluster.run_folder import RunFolder
    from protocols.config import load_config

    folder = RunFolder(load_config(None, [f"output_dir={tmp_path}"]))
    folder.log(1, {"reward/mean": 0.25, "reward_worker/samples": 8})
    folder.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.25, "reward_worker/samples": 8.0}]


@pytest.mark.slow
def test_short_run_logs_reward_worker_counters_eval_sets_and_tool_metrics(ray_cluster, tmp_path):
    """4 DAPO steps on the demo with the calculator offered and the rollout autoscaler on (1 to 2 workers), evaluation
    of the `demo` set at step 2 and after training with 2 samples. The untrained demo model cannot write a call's
    tags, so every sample is one turn with no call; the tools/* metrics are there all the same (one run for all: a
    Trainer's start costs more than its steps)."""
    from cluster.trainer import Trainer
    from protocols.config import load_config

    cfg = load_config(None, [
        f"output_dir={tmp_path}", "logging.plots=false",
        "train.steps=4", "train.eval_every=2", "train.eval_sets=[demo]",
        "train.eval_samples=2", "learner.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "data.num_eval_prompts=16", "train.max_staleness=0", "reward.num_workers=2", "tools.builtin=[calculator]",
        # the autoscaler decides every step: at max_staleness 0 the learner waits for each batch's generation, so
        # with patience 1 it grows the pool to its limit of 2 (and no further), after which the cooldown holds it
        "rollout.autoscale.enabled=true", "rollout.autoscale.max_workers=2", "rollout.autoscale.patience_steps=1",
        "rollout.autoscale.cooldown_steps=1"])
    trainer = Trainer(cfg)
    step, joined_at = trainer.step, []

    def step_after_the_grow_serves(groups):
        # the grow the autoscaler asked for after step 1 starts its engine while step 2 trains; the engine is
        # waited for here so that it joins after step 2
        joining = trainer.pools["rollout"].joining
        if joining is not None:
            ray_cluster.wait(joining.probes, num_returns=len(joining.probes), timeout=300)
            joined_at.append(trainer.version)
        return step(groups)

    trainer.step = step_after_the_grow_serves
    try:
        summary = trainer.run()
        pool_size = len(trainer.rollout_workers)
        worker_stats = ray_cluster.get(trainer.controller.get_worker_stats.remote())
    finally:
        trainer.shutdown()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:  # autoscale/*: one decision per step, logged with its reason; size: the workers serving
        assert row["autoscale/size"] == row["rollout/num_workers"] <= row["autoscale/target"] <= 2.0
        assert 0 <= row["autoscale/wait_frac"] <= 1
        assert sum(v for k, v in row.items() if k.startswith("autoscale/reason_")) == 1.0
    # the one grow: a step whose learner waited over grow_wait_frac=0.1 of it, 1 -> 2 workers, never past max_workers;
    # 1 still serves at that step (the engine starts while the next trains), 2 from step 2's end
    [grow] = [r for r in rows if r["autoscale/change"] != 0.0]
    assert grow["autoscale/change"] == 1.0 and grow.get("autoscale/reason_grow_waiting") == 1.0
    assert grow["autoscale/wait_frac"] > 0.1 and grow["autoscale/target"] == 2.0 and "autoscale/failed" not in grow
    assert grow["step"] == 1 and grow["autoscale/size"] == 1.0 and joined_at == [1]
    # after step 2 the engine (waited for before it) joins, then the cooldown holds; the pool stays at its limit
    assert rows[1]["autoscale/reason_hold_cooldown"] == 1.0
    assert [r["rollout/num_workers"] for r in rows] == [1.0, 2.0, 2.0, 2.0] and pool_size == 2
    # the new worker (controller id 1) loaded the newest weights before its run, the driver stepping on meanwhile
    # (at max_staleness 0 worker 0 may take every prompt of steps 3 and 4 before that load ends)
    assert max(worker_stats[1]["versions_seen"]) >= 2, worker_stats
    print(f"\nautoscaler: grew 1 -> 2 after step {grow['step']:.0f} (learner waited "
          f"{grow['autoscale/wait_frac']:.0%} of it); step 2 trained while its engine started")
    assert not (tmp_path / "plots").exists()  # logging.plots=false (tests/test_plots.py draws the tool figures)
    # tools/*: each logged step and their totals in the summary
    for row in rows:
        assert row["tools/turns_per_sample"] == 1.0 + row["tools/calls_per_sample"]
        assert 0 <= row["tools/call_rate"] <= 1 and 0 <= row["tools/token_share"] < 1
        assert {"tools/errors_unknown_tool", "tools/errors_exception", "tools/errors_timeout",
                "tools/truncated_outputs", "tools/malformed_calls", "tools/max_turns_share"} <= set(row)
    assert set(summary["tools"]) == {k for k in rows[0] if k.startswith("tools/")}
    names = ("samples", "error_exception", "error_timeout", "error_crash", "process_restarts", "seconds_per_sample",
             "reward_mean", "correct_rate")
    assert all(f"reward_worker/{n}" in r for r in rows for n in names)
    # every group the workers scored reached the controller (no failures), 4 samples each; groups abandoned
    # unscored at the stop count as received too. The logged lines hold what arrived by each step, the summary
    # every count
    total = summary["reward_workers"]["reward_worker/samples"]
    q = summary["queue"]
    assert total == (q["queue/received"] - q.get("queue/dropped_aborted_at_stop", 0)) * 4
    assert sum(r["reward_worker/samples"] for r in rows) <= total
    assert total >= 4 * 4 * 4  # at least the 4 trained batches of 16 samples
    # generated/: every sample received by each logged step, counted once (the windows do not overlap), dropped
    # groups' too: at least the 64 trained samples, at most every received group's 4
    generated = sum(r["generated/samples"] for r in rows)
    assert 4 * 4 * 4 <= generated <= q["queue/received"] * 4
    assert all(r["generated/length_p50"] <= r["generated/length_p99"] <= r["generated/length_max"]
               for r in rows if r["generated/samples"])
    assert summary["reward_workers"]["reward_worker/error_timeout"] == 0
    # the demo set at step 2 (in metrics.jsonl) and after training (summary): pass@1 <= pass@2, both in [0, 1]
    mid = rows[1]
    assert mid["eval/demo/samples"] == 16 and 0 <= mid["eval/demo/accuracy"] <= 1
    assert 0 <= mid["eval/demo/pass@1"] <= mid["eval/demo/pass@2"] <= 1
    after = summary["eval_after"]
    assert after["eval/demo/pass@1"] <= after["eval/demo/pass@2"]
    # the default set's eval/accuracy is still there, and the harness's rows were written per evaluation
    assert "eval/accuracy" in mid
    lines = (tmp_path / "eval" / "demo_step000002.jsonl").read_text().splitlines()
    assert len(lines) == 16 * (1 + 2)


def test_length_metrics_nearest_rank():
    from protocols.metrics import length_metrics

    # 100 lengths 1..100: p50 is the 50th smallest (50), p99 the 99th (99), max 100.
    assert length_metrics(list(range(100, 0, -1))) == {
        "response/length_p50": 50.0, "response/length_p99": 99.0, "response/length_max": 100.0}
    # 3 lengths: p50 = rank ceil(1.5) = 2nd (7); p99 = rank ceil(2.97) = 3rd (900).
    assert length_metrics([900, 5, 7]) == {
        "response/length_p50": 7.0, "response/length_p99": 900.0, "response/length_max": 900.0}


def test_tensorboard_gets_every_finite_scalar_of_each_logged_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from cluster.run_folder import RunFolder
    from protocols.config import load_config

    folder = RunFolder(load_config(None, [f"output_dir={tmp_path}"]))
    folder.log(1, {"reward/mean": 0.5, "time/step_s": 2.0, "eval/accuracy": float("nan")})
    folder.log(2, {"reward/mean": 0.75, "time/step_s": 1.0})
    folder.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "time/step_s"]  # NaN is not a scalar there
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("time/step_s")] == [(1, 2.0), (2, 1.0)]
