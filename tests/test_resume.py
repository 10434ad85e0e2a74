"""Resume: the checkpoint layout (atomic write, `latest`, pruning, refusals) and, on the real stack, a demo run
killed with SIGKILL after a checkpoint and resumed to its end."""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from actors.controller import RolloutController, SyncRequest
from cli.driver_session import kill_session, launch_train
from cli.main import main
from cluster import checkpoint
from cluster.checkpoint import CheckpointError
from cluster.run_folder import RunFolder
from protocols.config import RunConfig, dump_config, load_config
from protocols.trajectory import Prompt


def fake_pieces(step: int, model_config: dict | None = None):
    """A writer of the pieces a checkpoint holds, with small stand-in contents."""
    def write(folder: Path) -> None:
        (folder / "policy").mkdir()
        (folder / "policy" / "config.json").write_text(json.dumps(model_config or {"hidden_size": 128}))
        (folder / "learner").mkdir()
        (folder / "learner" / "rng_rank0.pt").write_bytes(b"x" * step)
        (folder / "state.json").write_text(json.dumps({"policy_version": step}))
        (folder / "config.yaml").write_text(dump_config(RunConfig()))
    return write


def names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.checkpoints_dir(run_dir).iterdir())


def test_latest_names_the_newest_complete_checkpoint_and_a_half_written_one_is_ignored(tmp_path):
    for step in (1, 2):
        checkpoint.save(tmp_path, step, keep=5, write_pieces=fake_pieces(step))
    # a crash while writing step 3: its temporary folder holds some pieces only
    half = checkpoint.checkpoints_dir(tmp_path) / "step_000003.tmp"
    half.mkdir()
    (half / "state.json").write_text("{")
    assert checkpoint.read_latest(tmp_path).name == "step_000002"
    assert checkpoint.find_resume_checkpoint(tmp_path).name == "step_000002"
    assert checkpoint.read_state(checkpoint.find_resume_checkpoint(tmp_path)) == {"policy_version": 2}


def test_a_writer_that_fails_midway_leaves_the_last_good_checkpoint_and_the_next_save_cleans_up(tmp_path):
    checkpoint.save(tmp_path, 1, keep=5, write_pieces=fake_pieces(1))

    def crash(folder: Path) -> None:
        (folder / "state.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 2, keep=5, write_pieces=crash)
    assert names(tmp_path) == ["latest", "step_000001", "step_000002.tmp"]
    assert checkpoint.find_resume_checkpoint(tmp_path).name == "step_000001"
    checkpoint.save(tmp_path, 2, keep=5, write_pieces=fake_pieces(2))
    assert names(tmp_path) == ["latest", "step_000001", "step_000002"]
    assert checkpoint.read_latest(tmp_path).name == "step_000002"


def test_a_complete_checkpoint_renamed_before_latest_was_updated_is_the_resume_point(tmp_path):
    for step in (1, 2):
        checkpoint.save(tmp_path, step, keep=5, write_pieces=fake_pieces(step))
    # the crash came between step 2's rename and the pointer's update
    (checkpoint.checkpoints_dir(tmp_path) / "latest").write_text("step_000001\n")
    assert checkpoint.find_resume_checkpoint(tmp_path).name == "step_000002"


def test_keep_checkpoints_prunes_the_oldest_after_latest_moves(tmp_path):
    (checkpoint.checkpoints_dir(tmp_path)).mkdir(parents=True)
    (checkpoint.checkpoints_dir(tmp_path) / "step_000001.tmp").mkdir()  # an old crash's leftover
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, keep=2, write_pieces=fake_pieces(step))
    # 4 saved, keep 2: steps 1 and 2 removed, with the leftover temporary folder
    assert names(tmp_path) == ["latest", "step_000003", "step_000004"]
    assert checkpoint.read_latest(tmp_path).name == "step_000004"


def test_resume_without_a_complete_checkpoint_names_the_folder_and_what_is_missing(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*no checkpoints/ subfolder"):
        checkpoint.find_resume_checkpoint(tmp_path)
    checkpoint.save(tmp_path, 5, keep=2, write_pieces=fake_pieces(5))
    folder = checkpoint.checkpoints_dir(tmp_path) / "step_000005"
    (folder / "state.json").unlink()
    (folder / "learner" / "rng_rank0.pt").write_bytes(b"xy")  # 2 bytes; the manifest says 5
    with pytest.raises(CheckpointError) as err:
        checkpoint.find_resume_checkpoint(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "step_000005 lacks state.json" in message
    assert "learner/rng_rank0.pt (size 2, manifest says 5)" in message


def test_cli_resume_without_a_checkpoint_exits_2_naming_the_folder(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text(dump_config(RunConfig(output_dir=str(tmp_path))))
    (checkpoint.checkpoints_dir(tmp_path) / "step_000004.tmp").mkdir(parents=True)
    assert main(["train", "--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--resume {tmp_path}: no complete checkpoint" in err and "latest pointer missing" in err
    assert "no step_N folder" in err


def test_cli_resume_refuses_another_output_dir(tmp_path, capsys):
    checkpoint.save(tmp_path, 1, keep=2, write_pieces=fake_pieces(1))
    (tmp_path / "config.yaml").write_text(dump_config(RunConfig(output_dir=str(tmp_path))))
    assert main(["train", "--resume", str(tmp_path), "--output-dir", str(tmp_path / "other")]) == 2
    assert "names another one" in capsys.readouterr().err


def test_a_config_that_changes_shapes_is_refused_naming_each_setting(tmp_path):
    model = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "vocab_size": 15}
    checkpoint.save(tmp_path, 1, keep=2, write_pieces=fake_pieces(1, model))
    folder = checkpoint.find_resume_checkpoint(tmp_path)
    new_model = tmp_path / "new_model"
    new_model.mkdir()
    (new_model / "config.json").write_text(json.dumps({**model, "hidden_size": 256}))
    new = load_config(None, ["rollout.samples_per_prompt=4", "learner.num_ranks=2", "learner.lr=1e-4",
                             "train.steps=900"]).model_dump(mode="json")
    with pytest.raises(CheckpointError) as err:
        checkpoint.check_compatible(folder, new, new_model)
    message = str(err.value)
    # defaults: samples_per_prompt 8, num_ranks 1; lr and steps may change, so they are not named
    assert "rollout.samples_per_prompt: checkpoint 8, now 4" in message
    assert "learner.num_ranks: checkpoint 1, now 2" in message
    assert "`hidden_size` (config.json)" in message and "checkpoint 128, now 256" in message
    assert "learner.lr" not in message and "train.steps" not in message
    # the same shapes pass, whatever else changed
    (new_model / "config.json").write_text(json.dumps(model))
    checkpoint.check_compatible(folder, load_config(None, ["learner.lr=1e-4", "train.steps=900"]).model_dump(
        mode="json"), new_model)


def prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_id=f"p{i}", prompt_token_ids=[i + 1], answer=str(i)) for i in range(n)]


def test_groups_in_flight_at_a_checkpoint_are_reissued_first_with_their_ids_and_prompts():
    c = RolloutController(prompts(20), prompts_per_step=2, max_staleness=0, drop_zero_variance=False, seed=0)
    granted = c.sync(SyncRequest(worker_id=0, version=0, want=2)).granted  # budget (0 + 0 + 1) * 2 = 2
    d = RolloutController(prompts(20), prompts_per_step=2, max_staleness=0, drop_zero_variance=False, seed=0)
    d.load_state_dict(json.loads(json.dumps(c.state_dict())))  # through JSON, as a checkpoint stores it
    assert d.budget(0) == 0  # both admitted groups still hold the window
    again = d.sync(SyncRequest(worker_id=5, version=0, want=2)).granted
    # the same ids (so the same sampling seeds) and prompts, leased to the new worker, admitted once
    assert again == granted and d.admitted == 2 and d.leases_of(5) == ["g0", "g1"]
    assert d.stats()["queue/reissue_pending"] == 0


def test_a_resumed_run_folder_drops_metrics_logged_past_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3, 4))
                                            + '{"step": 5, "x"')  # step 5 cut short by the kill
    folder = RunFolder(RunConfig(output_dir=str(tmp_path)), resume_step=2)
    folder.log(3, {"x": 30.0})
    folder.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(1, 1), (2, 2), (3, 30.0)]


# --- the real stack: kill the driver after a checkpoint, resume, finish ------------------------------------------
def run_cli(args: list[str], log: Path) -> subprocess.Popen:
    return launch_train(args, log, {"DS_ACCELERATOR": "cpu"})


def metrics_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            pass
    return steps


def saved_adam_state(learner_dir: Path) -> dict:
    """Adam's step and moment sums read from the DeepSpeed files on disk (rank 0's optimizer partition)."""
    files = sorted((learner_dir / "ds").glob("*optim_states.pt"))
    assert files, list((learner_dir / "ds").iterdir())
    state = torch.load(files[0], map_location="cpu", weights_only=False)["optimizer_state_dict"]
    base = state["base_optimizer_state"]
    groups = base["state"].values() if isinstance(base, dict) else base
    steps = [float(g["step"]) for g in groups if "step" in g]
    groups = base["state"].values() if isinstance(base, dict) else base
    exp_avg = sum(float(g["exp_avg"].double().abs().sum()) for g in groups)
    return {"step": max(steps), "exp_avg_abs_sum": exp_avg}


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_and_trains_every_group_once(tmp_path):
    run_dir = tmp_path / "run"
    settings = [f"output_dir={run_dir}", "logging.plots=false",
                "train.steps=6", "train.save_every=2", "train.keep_checkpoints=2",
                "learner.prompts_per_step=4", "rollout.samples_per_prompt=4", "data.num_eval_prompts=16",
                "train.max_staleness=1", "rollout.prompts_in_flight=8", "algorithm.preset=grpo"]
    first = run_cli(settings, tmp_path / "first.log")
    try:
        # SIGKILL once a checkpoint exists and a step past it is logged (that step must then be trained again;
        # the next checkpoint may still land before the kill does, then nothing is trained twice)
        deadline = time.time() + 600
        while time.time() < deadline and first.poll() is None:
            if checkpoint.read_latest(run_dir) is not None and max(metrics_steps(run_dir), default=0) >= 3:
                break
            time.sleep(0.05)
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        kill_session(first)
    resume_point = checkpoint.find_resume_checkpoint(run_dir)
    saved = checkpoint.read_state(resume_point)
    step = saved["policy_version"]
    assert step in (2, 4) and max(metrics_steps(run_dir)) >= step
    on_disk = saved_adam_state(resume_point / "learner")
    assert on_disk["step"] == step  # one Adam step per policy version

    second = run_cli(["--resume", str(run_dir)], tmp_path / "second.log")
    try:
        assert second.wait(timeout=900) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        kill_session(second)
    summary = json.loads((run_dir / "summary.json").read_text())
    # the optimizer state came back: Adam's step and first moment as saved on disk
    loaded = summary["resume"]["optimizer_loaded"][0]
    assert loaded["step"] == on_disk["step"]
    assert loaded["exp_avg_abs_sum"] == pytest.approx(on_disk["exp_avg_abs_sum"], rel=1e-12)
    # the version and the metrics step continue: every step 1..6 logged exactly once
    assert summary["resume"]["policy_version"] == step and summary["steps"] == 6
    assert metrics_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # every admitted group trained once at most; admitted = trained + dropped (by reason) + queued + in flight
    trained = summary["trained_group_ids"]
    assert len(trained) == len(set(trained)) == 6 * 4
    assert trained[: step * 4] == saved["trained_group_ids"]
    q = summary["queue"]
    dropped = sum(v for k, v in q.items() if k.startswith("queue/dropped_"))
    assert q["queue/admitted"] == q["queue/trained"] + dropped + q["queue/depth"] + q["queue/in_flight"]
    assert q["queue/trained"] == len(trained) and q["queue/in_flight"] == q["queue/reissue_pending"] == 0
    # the groups in flight at the checkpoint were re-issued, not lost
    reissued = {g for g, _ in saved["controller"]["in_flight"]}
    assert summary["resume"]["reissued_groups"] == len(reissued)
    # the timings cover the whole run: the part before the checkpoint is carried over, not restarted at zero
    assert saved["wall_seconds"] > 0 and saved["phase_totals"]["step_s"] > 0
    assert summary["wall_seconds"] > saved["wall_seconds"]
    assert summary["train_seconds"] > saved["phase_totals"]["step_s"]
    assert summary["phase_seconds"]["learner_s"] > saved["phase_totals"]["learner_s"]
    # a final model and checkpoints: the newest two, the last at step 6
    assert Path(summary["final_model"], "config.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000004", "step_000006"]


def _rng_draw(rank) -> list[float]:
    """Runs inside a learner rank's process: the next draws of the RNGs a checkpoint restores."""
    import random

    import numpy as np

    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_learner_state_on_two_ranks_loads_into_a_new_group_that_continues_like_the_uninterrupted_one(
        ray_cluster, tiny_models, tmp_path, zero_stage):
    import ray

    from cluster.learner_group import LearnerGroup
    from learner.objective import count_normalizer
    from tests.conftest import start_together
    from tests.test_learner_sharding import make_batch

    cfg = load_config(None, ["learner.num_ranks=2", f"learner.zero_stage={zero_stage}", "learner.prompts_per_step=2",
                             "rollout.samples_per_prompt=4", "learner.micro_batch_size=2", "learner.lr=1e-3",
                             "algorithm.preset=dapo"])

    def step(group: LearnerGroup, seed: int) -> None:
        batch = make_batch(8, seed)
        group.train_step(batch, count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens))

    def weights(group: LearnerGroup) -> dict:
        packed = ray.get(group.publish_weights().refs[0])
        return {k: torch.from_numpy(v.copy()) for k, (_, v) in packed.items()}

    folder = tmp_path / "learner"
    folder.mkdir()
    # Both groups start at once (a start is mostly imports and waits); the second touches nothing until it loads
    # the first one's saved state, which restores its weights, Adam moments and RNG states.
    uninterrupted, resumed = start_together(lambda: LearnerGroup(cfg, tiny_models["untied"]),
                                            lambda: LearnerGroup(cfg, tiny_models["untied"]))
    try:
        try:
            step(uninterrupted, seed=0)
            saved = uninterrupted.save_state(str(folder))
            draws = ray.get([r.__ray_call__.remote(_rng_draw) for r in uninterrupted.ranks])
            step(uninterrupted, seed=1)
            expected = weights(uninterrupted)
        finally:
            uninterrupted.shutdown()
        # one Adam step taken on each rank's partition, with a moment that moved
        assert [d["step"] for d in saved] == [1.0, 1.0] and all(d["exp_avg_abs_sum"] > 0 for d in saved)
        loaded = resumed.load_state(str(folder))
        assert ray.get([r.__ray_call__.remote(_rng_draw) for r in resumed.ranks]) == draws
        step(resumed, seed=1)
        got = weights(resumed)
    finally:
        resumed.shutdown()
    assert loaded == saved
    # the second step from the restored weights and Adam moments lands where the uninterrupted run's did
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-7, msg=name)
