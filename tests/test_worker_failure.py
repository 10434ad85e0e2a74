"""Worker failure: a killed rollout, reward, reference or teacher worker is replaced, a killed critic rank restarts the
critic group, and the run finishes with every group accounted for; a non-finite loss skips the update on every
learner rank, bitwise; a dead learner rank stops the next step with an error naming it."""

import math
import re

import pytest
import ray
import torch

from learner.objective import count_normalizer
from protocols.config import load_config
from protocols.metrics import unknown_names
from tests.conftest import at_once
from tests.test_learner_sharding import make_batch



# --- the controller's side (plain Python) ----------------------------------------------------------------------
def test_a_dead_workers_id_is_retired_and_its_groups_counted_under_the_reason():
    from actors.controller import SyncRequest
    from tests.test_control_plane import controller

    c = controller(max_staleness=1)  # budget (0 + 1 + 1) * 2 = 4
    assert len(c.sync(SyncRequest(worker_id=0, version=0, want=3)).granted) == 3
    assert c.release_worker(0, "rollout_worker_died") == ["g0", "g1", "g2"]
    assert c.queue.dropped["rollout_worker_died"] == 3 and c.budget(0) == 4  # 4 - (3 admitted - 3 dropped)
    # a call the dead worker still had in flight is granted nothing; its replacement (a new id) gets work
    assert c.sync(SyncRequest(worker_id=0, version=0, want=2)).granted == []
    assert [g for g, _ in c.sync(SyncRequest(worker_id=2, version=0, want=2)).granted] == ["g3", "g4"]
    s = c.stats()
    assert s["queue/admitted"] == s["queue/received"] + s["queue/leased"] == 5  # 3 dropped + 2 leased


def test_the_driver_sets_each_roles_live_list_on_the_controllers_scoring_stage():
    from tests.test_control_plane import controller

    c = controller()
    c.set_scoring_workers({"reward": ["r0"], "reference": ["ref0"], "teacher": []})
    assert c.set_reward_workers(["r0", "r1"]) == 2  # a replacement: the role's second list
    assert c.set_model_workers("reference", ["ref1"]) == 2 and c.set_model_workers("teacher", ["t0", "t1"]) == 2
    assert c.stage.workers == {"reward": ["r0", "r1"], "reference": ["ref1"], "teacher": ["t0", "t1"]}
    with pytest.raises(ValueError, match="unknown scoring role 'judge'"):
        c.set_model_workers("judge", ["j0"])


@ray.remote(num_cpus=0)
class StandInScorer:
    """A reward and reference worker stand-in with the methods the scoring stage calls."""

    def score_groups(self, *groups):
        return [([float(i % 2) for i in range(len(g.trajectories))], [None] * len(g.trajectories)) for g in groups]

    def score_rows(self, *groups):
        return ([len(g.trajectories) for g in groups],
                *([[-1.0] * len(t.response_token_ids) for t in g.trajectories] for g in groups))

    def ping(self):
        return 0


def unscored_header(group_id: str):
    """The header a rollout worker hands over for `group_id`, its group put in the object store."""
    from protocols.group_header import GroupHeader
    from tests.test_replay_queue import make_group

    group = make_group(group_id, [0, 0], 0)
    return GroupHeader.of(group, ray.put(group))


def stats_once(actor, done, timeout_s: float = 30.0) -> dict:
    """The controller's stats once `done(stats)` holds (the stage scores in the background)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not done(stats := ray.get(actor.stats.remote())) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("role", ["reward", "reference"])
def test_the_scoring_stage_sends_a_dead_workers_group_to_a_live_one_then_drops_it(ray_cluster, role):
    """One rule for every role: the task of a dead worker goes to the live one of its role (counted
    `rescored_<role>_worker_died`); with none left alive after fault.max_rescore_attempts sends, the group is
    dropped `<role>_worker_died`. The group's lease moved to the stage at hand-over: the rollout worker's death
    would not drop it. The run goes on (no fatal error)."""
    from actors.controller import ControllerActor, SyncRequest
    from tests.test_replay_queue import make_prompts

    dead = StandInScorer.remote()
    ray.get(dead.ping.remote())
    ray.kill(dead)
    live = StandInScorer.remote()
    actor = ray.remote(ControllerActor).options(num_cpus=0).remote(make_prompts(20), 2, 1, False, 0, 1,
                                                                     max_rescore_attempts=1, scoring_timeout_s=3.0)
    try:
        g = [g for g, _ in ray.get(actor.sync.remote(SyncRequest(worker_id=0, version=0, want=3))).granted]
        lists = {"reward": [live], "reference": [live]}
        ray.get(actor.set_scoring_workers.remote({**lists, role: [dead, live]}))
        for x in g[:2]:  # two hand-overs, two batches: the round robin sends one of them to the dead worker
            ray.get(actor.sync.remote(SyncRequest(worker_id=0, version=0, scored=[(x, unscored_header(x))])))
        assert ray.get(actor.release_worker.remote(0)) == [g[2]]  # the worker died: only the group it still held
        stats = stats_once(actor, lambda s: s["queue/depth"] == 2)
        assert stats["queue/depth"] == 2 and stats["queue/scoring"] == 0
        assert stats[f"queue/rescored_{role}_worker_died"] == 1  # one batch met the dead worker, the other the live
        # only dead workers left: one more send, then no live worker within scoring_timeout_s: dropped under the
        # role's reason
        ray.get(actor.set_scoring_workers.remote({**lists, role: [dead]}))
        ray.get(actor.sync.remote(SyncRequest(worker_id=1, version=0, want=1)))
        ray.get(actor.sync.remote(SyncRequest(worker_id=1, version=0, scored=[("g3", unscored_header("g3"))])))
        stats = stats_once(actor, lambda s: s.get(f"queue/dropped_{role}_worker_died", 0) == 1)
        assert stats[f"queue/dropped_{role}_worker_died"] == 1 and stats["queue/leased"] == 0
        assert stats["queue/admitted"] == stats["queue/depth"] + 2  # 2 queued, 1 worker_lost, 1 dropped
        # no fatal error: the run goes on
        assert {h.group_id for h in ray.get(actor.wait_batch.remote(0, 0.1))} == set(g[:2])
    finally:
        ray.kill(actor)
        ray.kill(live)


# --- the learner ------------------------------------------------------------------------------------------------
def normalizer_of(batch, cfg):
    return count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens)


def snapshots(group) -> list[dict[str, torch.Tensor]]:
    return ray.get([rank.state_snapshot.remote() for rank in group.ranks])


def steps_around_a_nonfinite_loss(model_path: str, num_ranks: int, zero_stage: int, dtype: str) -> tuple:
    """A finite step, a step whose loss is NaN on one sample, another finite step, on a real LearnerGroup. Returns
    their metrics and each rank's state snapshots before and after the NaN step and after the next one. With 2
    ranks, rank 1 is then killed and one more step tried: the last item is the error it raised (None otherwise)."""
    from cluster.learner_failure import LearnerRankLost
    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, [f"learner.num_ranks={num_ranks}", f"learner.zero_stage={zero_stage}",
                             f"model.dtype={dtype}", "learner.prompts_per_step=2", "rollout.samples_per_prompt=4",
                             "learner.micro_batch_size=2", "learner.lr=1e-3", "algorithm.preset=dapo"])
    samples = make_batch(8)
    advantages = samples.advantages.clone()
    # one sample's advantages are NaN: with 2 ranks it sits in one rank's shard only, so the ranks must agree
    advantages[5, : int(samples.response_lengths[5])] = math.nan
    poisoned = samples.with_fields(advantages=advantages)
    norm = normalizer_of(samples, cfg)
    group = LearnerGroup(cfg, model_path)
    try:
        first = group.train_step(samples, norm)  # a finite step first, so Adam's moments and step count exist
        before = snapshots(group)
        skipped = group.train_step(poisoned, norm)
        after_skip = snapshots(group)
        later = group.train_step(samples, norm)
        after_later = snapshots(group)
        lost = None
        if num_ranks == 2:
            ray.kill(group.ranks[1])
            try:
                group.train_step(samples, norm)
            except LearnerRankLost as err:
                lost = err
    finally:
        group.shutdown()
    return first, skipped, later, before, after_skip, after_later, lost


@pytest.mark.slow
def test_nonfinite_loss_skips_the_update_bitwise_and_a_dead_rank_stops_the_next_step(ray_cluster, tiny_models):
    """2 ranks under ZeRO-2 in float32, and 1 rank under ZeRO-3 in bfloat16: the two groups run at once. The
    2-rank group then loses rank 1: rank 0 waits in a collective for the dead one, and the step's error comes from
    rank 1's failure, at once, naming the rank and its node."""
    from cluster.learner_failure import LearnerRankLost

    settings = [(2, 2, "float32"), (1, 3, "bfloat16")]
    runs = at_once(*[(steps_around_a_nonfinite_loss, tiny_models["untied"], *s) for s in settings])
    lost = runs[0][-1]
    assert isinstance(lost, LearnerRankLost), repr(lost)
    assert re.search(r"learner rank 1 on node [0-9a-f]+ \(.+\) died during a training step", str(lost)), str(lost)
    for setting, (first, skipped, later, before, after_skip, after_later, _) in zip(settings, runs):
        assert first["learner/skipped_nonfinite"] == 0, setting
        assert skipped["learner/skipped_nonfinite"] == 1 and math.isnan(skipped["loss"]), setting
        assert not math.isfinite(skipped["grad_norm_max"]), setting
        for rank, (b, a) in enumerate(zip(before, after_skip)):
            assert b.keys() == a.keys() and any(k.startswith("state/") for k in b), (setting, rank)
            for key in b:  # weights, fp32 master partitions, Adam moments and step counts: bitwise the same
                assert torch.equal(b[key], a[key]), (setting, rank, key)
        # the next finite step trains: the count stays 1 and every rank's weights and moments move
        assert later["learner/skipped_nonfinite"] == 1 and math.isfinite(later["loss"]), setting
        for rank, (a, c) in enumerate(zip(after_skip, after_later)):
            assert any(not torch.equal(a[k], c[k]) for k in a if k.startswith("param/")), (setting, rank)
            assert any(not torch.equal(a[k], c[k]) for k in a if k.startswith("state/")), (setting, rank)


# --- the whole run ------------------------------------------------------------------------------------------------
# One run kills a worker of each role in turn (a Trainer's start costs most of a test's time here); each kill waits
# for the previous replacement, and each role's counters and queue reasons are its own. The stats just before the
# reward worker's kill show that the reference and critic deaths before it were not taken for a reward worker's.
KILLS = [("rollout", 2), ("reference", 4), ("critic", 6), ("teacher", 7), ("reward", 9)]
"""(role, kill once the learner has trained this many batches), in order. The rollout worker goes first: its
replacement's start (an engine) takes about as long as the other worker needs for the remaining steps."""


def run_and_kill(tmp_path, kills: list[tuple[str, int]], steps: int, *overrides: str) -> tuple[dict, list[str],
                                                                                                list[dict], dict]:
    """A demo run (2 rollout and 2 reward workers) of `steps` steps in which, for each (role, kill_after_steps) of
    `kills` in turn, `role` worker 0 (rollout, reward, reference, teacher, or critic rank 0) is killed once the learner has
    trained `kill_after_steps` batches and its replacement is counted. Returns (summary, trained group ids, metrics
    rows, {"groups": the trained groups, "restart_s": {role: seconds from its kill to its replacement counted},
    "stats_before": {role: the controller's stats just before its kill}})."""
    import json
    import threading
    import time

    from cluster.trainer import Trainer
    from tests.test_pipeline import demo_config

    cfg = demo_config(tmp_path, f"train.steps={steps}", "train.max_staleness=1", "rollout.num_workers=2",
                      "reward.num_workers=2", "rollout.prompts_in_flight=8", "data.num_eval_prompts=20",
                      *overrides)
    trainer = Trainer(cfg)
    killed: list[str] = []
    seen: dict = {"groups": [], "restart_s": {}, "stats_before": {}}
    step = trainer.step
    trainer.step = lambda groups: (seen["groups"].extend(groups), step(groups))[1]  # record what is trained

    def killer() -> None:
        for role, kill_after_steps in kills:
            while ray.get(trainer.controller.stats.remote())["queue/trained"] < kill_after_steps * 8:
                time.sleep(0.2)
            # a rollout worker is killed while it holds groups (leases), so there is something to release
            while role == "rollout" and not ray.get(trainer.controller.leases_of.remote(0)):
                time.sleep(0.01)
            seen["stats_before"][role] = ray.get(trainer.controller.stats.remote())
            ray.kill(trainer.supervisor.workers(role)[0])
            start = time.monotonic()
            killed.append(role)
            while not trainer.supervisor.replaced[role] and time.monotonic() - start < 600:
                time.sleep(0.05)
            seen["restart_s"][role] = time.monotonic() - start

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        summary = trainer.run()
        trained = list(trainer.trained_group_ids)
    finally:
        trainer.shutdown()
    assert killed == [role for role, _ in kills], f"the run ended before every kill: {killed}"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, trained, rows, seen


def check_finished_and_accounted(tmp_path, summary: dict, trained: list[str], rows: list[dict],
                                 steps: int = 12) -> dict:
    from pathlib import Path

    # the run finished: every step, final model, held-out accuracy after, summary.json on disk
    assert summary["steps"] == steps and len(rows) == steps
    assert Path(summary["final_model"], "config.json").is_file() and (tmp_path / "summary.json").is_file()
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    # every admitted group was trained, dropped with a reason, or is still queued; none trained twice
    q = summary["queue"]
    dropped = {k: v for k, v in q.items() if k.startswith("queue/dropped_")}
    assert q["queue/admitted"] == q["queue/trained"] + sum(dropped.values()) + q["queue/depth"], (q, dropped)
    assert len(trained) == len(set(trained)) == q["queue/trained"] == steps * 8
    return dropped


@pytest.mark.slow
def test_a_killed_worker_of_each_role_is_replaced_and_the_run_finishes(ray_cluster, tmp_path, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="cluster.critic_group")
    caplog.set_level(logging.WARNING, logger="cluster.rollout_pool")
    from cluster.model_folder import resolve_model_path
    from tests.test_pipeline import demo_config

    steps = 14
    # the teacher is the policy's own starting folder: the same vocabulary, a real second model worker. PPO's
    # advantage takes a 0.2 share of the teacher's per-token signal (on-policy distillation beside a critic)
    teacher = resolve_model_path(demo_config(tmp_path))
    summary, trained, rows, seen = run_and_kill(tmp_path, KILLS, steps, "algorithm.preset=ppo",
                                                "reference.num_workers=1", "critic.num_workers=2",
                                                f"teacher.path={teacher}", "teacher.num_workers=1",
                                                "algorithm.distillation.weight=0.2")
    dropped = check_finished_and_accounted(tmp_path, summary, trained, rows, steps)
    print(f"kill -> replacement counted in {seen['restart_s']} s; queue {summary['queue']}")
    assert summary["replaced_workers"] == {"rollout": 1, "reward": 1, "reference": 1, "teacher": 1, "critic": 1}
    for role in ("rollout", "reward", "reference", "teacher", "critic"):
        assert rows[-1][f"fault/replaced_{role}"] == 1 and rows[0][f"fault/replaced_{role}"] == 0, role
    assert unknown_names(rows[-1]) == []  # the supervisor's counters are documented in protocols/metrics.py
    q = summary["queue"]

    # rollout: the dead worker's leased groups were released under their own reason, every one it held at its death.
    # It is killed once it holds some, but it may hand them back before the kill lands (a loaded machine), so the
    # count is the one its replacement released, read from the pool's log
    died = r"rollout worker 0 \(id 0\) died .*; (\d+) leased groups released"
    [released] = [int(m.group(1)) for r in caplog.records if (m := re.search(died, r.getMessage()))]
    assert dropped.get("queue/dropped_rollout_worker_died", 0) == released, (dropped, released)
    # the replacement (slot 0's final report) loaded the weights current when it started (version 2 or later,
    # since 2 batches were trained before the kill) and then took work (its engine ran decode steps)
    replacement = summary["rollout"][0]
    assert replacement["versions_seen"][0] == 0 and replacement["versions_seen"][1] >= 2, replacement
    assert replacement["generate_s"] > 0, replacement

    # reference and teacher: every trained trajectory carries the frozen reference's and the teacher's log-probs,
    # one per response token (the teacher's death left no group trained without them; the driver refuses such a
    # batch). At version 0 the teacher, the same folder as the policy's start, agrees
    # with vLLM's behavior log-probs as the reference does.
    for t in [t for g in seen["groups"] for t in g.trajectories]:
        assert t.ref_logprobs is not None and len(t.ref_logprobs) == len(t.response_token_ids)
        assert t.teacher_logprobs is not None and len(t.teacher_logprobs) == len(t.response_token_ids)
        if t.max_version == 0:
            assert max(abs(a - b) for a, b in zip(t.teacher_logprobs, t.behavior_logprobs)) < 1e-3
    assert "queue/dropped_teacher_failed" not in q, q
    assert all("teacher/reverse_kl_mean" in r and 0.0 <= r["teacher/advantage_share"] < 1.0 for r in rows)
    assert summary["teacher_workers"]["teacher_worker/groups"] > 0
    # groups whose reference scoring died were sent again or dropped under their own reason, never taken for a
    # reward worker's or a forward's failure: up to the reward worker's kill, no group was rescored for one
    assert "queue/dropped_reference_failed" not in q and "queue/dropped_reward_failed" not in q, q
    before_reward_kill = seen["stats_before"]["reward"]
    assert before_reward_kill["queue/rescored_reward_worker_died"] == 0, before_reward_kill
    assert "queue/dropped_reward_worker_died" not in before_reward_kill, before_reward_kill

    # critic: rank 0 was killed, the new group started from rank 1's full weights (ZeRO-2), and the log says so
    assert any("weights from the full weights of surviving rank 1" in r.getMessage() for r in caplog.records)
    # the critic version never went back and kept pace with the policy
    versions = [r["critic/version"] for r in rows if "critic/version" in r]
    assert versions == sorted(versions) and versions[-1] >= steps - 2, versions
    assert (tmp_path / "final_critic" / "value_head.pt").is_file()
    # the critic values each batch at train time: its death drops no group
    assert "queue/dropped_critic_failed" not in dropped, dropped

    # reward: groups whose scoring died with the worker went to the other one (or were dropped under their reason)
    assert q["queue/rescored_reward_worker_died"] + dropped.get("queue/dropped_reward_worker_died", 0) >= 1, q
    # evaluation after the run used the live workers: no held-out check was lost to the dead one
    assert "eval/error_worker_died" not in summary["eval_after"], summary["eval_after"]
