"""A run fed by outside agents alone (gateway.outside_only), without a cluster: the settings it refuses, a worker
that asks for no prompts but reports its counters, a controller that leases nothing and trains the session groups
that arrive (stale ones dropped), the endpoints file agents read, and what a waiting driver says."""

import json

import pytest

from actors.controller import RolloutController
from actors.controller_messages import SyncReply
from actors.worker_policy import PolicySettings, WorkerPolicy
from cluster.gateway_endpoints import session_totals, stall_message, waiting_line, write_endpoints
from gateway.sessions import SESSION_GROUP_PREFIX
from protocols.config import ConfigError, load_config
from tests.test_replay_queue import ask, make_group

OUTSIDE = ["gateway.enabled=true", "gateway.outside_only=true"]


def test_outside_only_refuses_what_needs_the_runs_own_prompts():
    assert load_config(None, OUTSIDE).gateway.outside_only
    refused = {
        "gateway.enabled=false": "set gateway.enabled=true",
        "gateway.agent=demos.products_agent:run": "Leave gateway.agent empty",
        "train.eval_every=5": "Set train.eval_every=0",
    }
    for override, fix in refused.items():
        with pytest.raises(ConfigError) as err:
            load_config(None, [*OUTSIDE, override])
        assert fix in str(err.value), str(err.value)
        assert "gateway." in str(err.value)
    # outside agents' groups pass the scoring stage as any group does, so a reference worker may score them
    assert load_config(None, [*OUTSIDE, "algorithm.preset=grpo", "reference.num_workers=1"]).reference.num_workers == 1


def test_an_outside_only_worker_asks_for_no_prompts_but_reports_every_health_check():
    cfg = load_config(None, [*OUTSIDE, "fault.health_check_s=2"])
    settings = PolicySettings.from_run(cfg)
    assert not settings.leases and settings.report_every_s == 2.0
    p = WorkerPolicy(settings, worker_id=0)
    assert p.sync_due(10.0, in_flight=0) and p.request(10.0, 0).want == 0  # the first call: counters, no prompts
    p.on_reply(SyncReply(stop=False, weights=None))
    assert p.want(0) == 0
    assert not p.sync_due(11.9, in_flight=0)  # nothing to hand over, 1.9 s since the last call
    assert p.sync_due(12.0, in_flight=0)  # 2 s: the counters go again
    p.on_scored(f"{SESSION_GROUP_PREFIX}0/1/task", "group", now=10.5)
    assert p.sync_due(10.5, in_flight=0)  # a session group goes at once (nothing in the engine to wait for)


def test_a_controller_fed_from_outside_leases_nothing_and_trains_the_session_groups():
    c = RolloutController([], prompts_per_step=2, max_staleness=1, drop_zero_variance=False, seed=0,
                          from_data=False)
    assert ask(c, worker_id=0, version=0, want=8) == []
    groups = [make_group(f"{SESSION_GROUP_PREFIX}0/{i}/task-{i}", [1.0, 0.0], version=0) for i in range(3)]
    assert ask(c, 0, 0, want=0, scored=groups) == []
    # each session group is admitted when it arrives: admitted 3 = trained 2 + queued 1
    batch = c.take_batch(learner_version=0)
    assert [g.group_id for g in batch] == [g.group_id for g in groups[:2]]
    stats = c.stats()
    assert (stats["queue/admitted"], stats["queue/trained"], stats["queue/depth"], stats["queue/in_flight"]) == \
        (3, 2, 1, 0)
    # at version 2 the queued group (sampled at 0) is past max_staleness 1: dropped and counted, not trained
    assert c.take_batch(learner_version=2) is None and c.stats()["queue/dropped_stale"] == 1
    state = c.state_dict()
    assert state["cursor"] is None and state["admitted"] == 3
    c.load_state_dict(json.loads(json.dumps(state)))
    assert c.stats()["data/epoch"] == 0


def test_the_endpoints_file_lists_the_workers_and_says_when_they_serve(tmp_path):
    cfg = load_config(None, [*OUTSIDE, f"output_dir={tmp_path}", "rollout.samples_per_prompt=4",
                             "learner.prompts_per_step=2"])
    folder = tmp_path / "gateway"
    folder.mkdir()
    for worker_id in (0, 1):
        url = f"http://127.0.0.1:{8000 + worker_id}"
        (folder / f"worker-{worker_id}.json").write_text(json.dumps({"worker_id": worker_id, "url": url,
                                                                      "sessions": f"{url}/sessions"}))
    path = write_endpoints(cfg, [1, 0], ready=True, policy_version=3)
    data = json.loads(path.read_text())
    assert data["ready"] and not data["finished"] and data["outside_only"]
    assert [w["url"] for w in data["workers"]] == ["http://127.0.0.1:8001", "http://127.0.0.1:8000"]
    assert (data["policy_version"], data["group_size"], data["groups_per_step"], data["max_calls_in_flight"]) == \
        (3, 4, 2, 64)
    data = json.loads(write_endpoints(cfg, [0, 1], ready=True, policy_version=5, finished=True).read_text())
    assert data["finished"] and not data["ready"]  # a finished run serves nothing, whatever `ready` was asked
    assert sorted(p.name for p in folder.iterdir()) == ["endpoints.json", "worker-0.json", "worker-1.json"]


def test_a_stalled_outside_only_run_says_what_its_agents_did_and_how_to_feed_it(tmp_path):
    cfg = load_config(None, [*OUTSIDE, f"output_dir={tmp_path}", "fault.batch_timeout_s=60", "learner.prompts_per_step=16"])
    reports = {0: {"gateway": {"sessions": 3, "sessions_rewarded": 1, "sessions_no_reward": 2, "groups": 0,
                               "groups_untrained": 1, "groups_open": 1}},
               1: {"gateway": {"sessions": 2, "open_sessions": 2, "groups_open": 1}}, 2: {}}
    sessions = session_totals(reports)
    assert (sessions["sessions"], sessions["groups_open"]) == (5, 2)
    queue = {"queue/depth": 0, "queue/in_flight": 0}
    line = waiting_line(cfg, 4, 61.0, queue, sessions)
    assert line.startswith("waiting 61 s for the batch of policy version 4: 0 of 16 groups queued")
    assert "gateway.outside_only=true" in line and "5 sessions were opened (1 rewarded, 2 finished without a " \
        "reward, 0 lost a call, 2 open)" in line and str(tmp_path / "gateway" / "endpoints.json") in line
    error = stall_message(cfg, 4, queue, sessions)
    assert "fault.batch_timeout_s=60.0" in error and "1 had no rewarded session" in error
    assert "learner.prompts_per_step=16" in error and "demos/outside_agent.py" in error
    # a run fed by its data set says only what is queued
    leased = load_config(None, [f"output_dir={tmp_path}"])
    assert "outside" not in waiting_line(leased, 4, 61.0, queue, {})
    assert "raise it if generation is that slow" in stall_message(leased, 4, queue, {})
