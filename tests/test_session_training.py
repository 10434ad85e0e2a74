"""A run with the session endpoint on (gateway.enabled): an agent program, written with the stock `openai` SDK
only, finds the endpoint in the run folder, plays two-call episodes in groups of the learner's size and posts
their rewards; the Trainer trains those groups beside its own prompts' groups, through the same queue and learner
(the client's reward replaces the reward workers' score)."""

import json
import threading
import time

import httpx
import openai
import pytest

from cluster.trainer import Trainer
from tests.conftest import record_batches
from tests.test_pipeline import tiny_gsm8k_config

pytestmark = pytest.mark.slow


def agent(run_dir, stop: threading.Event, played: list) -> None:
    """Groups of two sessions on one question; each session asks, then asks again after a follow-up; the reward
    is 1 for the session whose last reply is longer (so the group has a signal)."""
    found = run_dir / "gateway" / "worker-0.json"
    while not found.is_file() and not stop.is_set():
        time.sleep(0.2)
    if stop.is_set():
        return
    url = json.loads(found.read_text())["url"]
    task = 0
    while not stop.is_set():
        task += 1
        try:
            sessions = [httpx.post(f"{url}/sessions", json={"group": f"task-{task}"}).json() for _ in range(2)]
            lengths = []
            for s in sessions:
                client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0, timeout=120)
                messages = [{"role": "user", "content": f"What is {task} + {task}?"}]
                first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
                messages += [first.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Are you sure?"}]
                second = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
                lengths.append(len(second.choices[0].message.content or ""))
            for s, length in zip(sessions, lengths):
                reward = float(length == max(lengths) and lengths[0] != lengths[1])
                httpx.post(f"{s['base_url'].rsplit('/v1', 1)[0]}/reward", json={"reward": reward},
                           headers={"Authorization": f"Bearer {s['api_key']}"})
            played.append(task)
        except (httpx.HTTPError, openai.OpenAIError):
            if stop.is_set():
                return
            time.sleep(0.2)  # the worker is between runs (evaluation, a restart): try again


def test_a_run_trains_the_groups_an_openai_sdk_agent_plays(ray_cluster, tmp_path):
    cfg = tiny_gsm8k_config(tmp_path, "rollout.prompts_in_flight=2", "algorithm.preset=grpo", "train.steps=6",
                            "train.max_staleness=4", "gateway.enabled=true")
    trainer = Trainer(cfg)
    batches = record_batches(trainer)
    stop, played = threading.Event(), []
    player = threading.Thread(target=agent, args=(tmp_path / "run", stop, played), daemon=True)
    player.start()
    try:
        summary = trainer.run()
    finally:
        stop.set()
        trainer.shutdown()
        player.join(30)
    trained = [g for _, groups in batches for g in groups]
    sessions = [g for g in trained if g.group_id.startswith("session-group/")]
    assert played and sessions, (played, [g.group_id for g in trained])
    for group in sessions:
        assert len(group.trajectories) == 2
        for t in group.trajectories:
            # one sample per two-call episode: the follow-up turn is context (no loss, version -1)
            assert t.context_spans and len(t.context_spans) == 1
            mask = t.loss_mask
            assert all(v == -1 and lp == 0.0 for v, lp, m in zip(t.token_versions, t.behavior_logprobs, mask)
                       if not m)
            assert t.reward in (0.0, 1.0)
    report = summary["rollout"][0]["gateway"]
    assert report["groups"] >= len(sessions) and report["sessions_rewarded"] >= 2 * len(sessions)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    # the endpoint's counters reach each step's log (protocols/metrics.py gateway_metrics)
    assert any(r.get("gateway/calls", 0) > 0 and r["gateway/calls_per_session"] > 0 for r in rows), rows[-1]
