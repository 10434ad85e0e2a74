"""A verifiers environment as the run's agent (gateway.verifiers_env, gateway/verifiers_env.py): an episode's rubric
rewards become the session's reward, a failed or unscored episode leaves its session untrained and counted, the
worker goes on; the settings are checked when the config loads. With the engine, a run trains the episodes of
demos/products_vf_env.py (a verifiers-shaped environment whose agent is the stock `openai` SDK), each sample exactly
the endpoint's per-call records, its reward the rubric's."""

import json
import math
import os
import re

import pytest

from demos.products_vf_env import Episode, Error, ProductsEnv, Task, TaskData, Trace, load_environment
from gateway.verifiers_env import KEY_VARIABLE_PREFIX, VerifiersAgent, episode_reward, task_for
from protocols.config import load_config
from protocols.trajectory import Prompt
from tests.test_agent_runner import start_runner


def trace(rewards: dict, metrics: dict | None = None, ok: bool = True) -> Trace:
    t = Trace(ok=ok, metrics=metrics or {})
    for name, value in rewards.items():
        if value is None:
            t.rewards[name] = None
        else:
            t.record_reward(name, *value)
    return t


def test_the_reward_is_the_traces_weighted_rewards_with_the_named_scores_as_info():
    # 1.0 x 0.75 + 0.5 x 0.5 = 1.0; the metric kept beside
    episode = Episode(ok=True, traces=[trace({"correct": (1.0, 0.75), "format": (0.5, 0.5)}, {"turns": 2})])
    assert episode_reward(episode) == {"correct": 1.0, "format": 0.5, "turns": 2.0, "reward": 1.0}


def test_two_traces_sum():
    # 1 + 0.5
    episode = Episode(ok=True, traces=[trace({"a": (1.0, 1.0)}), trace({"b": (0.5, 1.0)})])
    assert episode_reward(episode)["reward"] == 1.5


@pytest.mark.parametrize("episode", [
    Episode(ok=False, traces=[trace({"correct": (1.0, 1.0)})]),  # a failed episode, even with a score
    Episode(ok=True, traces=[]),  # no agent ran
    Episode(ok=True, traces=[trace({"correct": None})]),  # scoring did not run
    Episode(ok=True, traces=[trace({"correct": (math.nan, 1.0)})]),
    Episode(ok=True, traces=[trace({"correct": (1.0, 1.0)}, {"len": math.inf})]),
])
def test_an_episode_without_a_sound_reward_is_not_trained(episode):
    assert episode_reward(episode) is None


def test_the_mapping_and_the_context_are_verifiers_own_where_it_is_installed():
    vf = pytest.importorskip("verifiers.v1")  # pip install relayrl[verifiers]
    from verifiers.v1.configs.client import resolve_api_key

    from gateway.verifiers_env import model_context

    os.environ[KEY_VARIABLE_PREFIX + "test"] = "session-key"
    try:
        ctx = model_context("policy", "http://127.0.0.1:1/sessions/s/v1", KEY_VARIABLE_PREFIX + "test")
        assert isinstance(ctx, vf.ModelContext) and isinstance(ctx.client, vf.EvalClientConfig)
        assert resolve_api_key(ctx.client) == "session-key"  # how verifiers' EvalClient reads the key
    finally:
        os.environ.pop(KEY_VARIABLE_PREFIX + "test")
    task = vf.TraceTask(type="Task", data=vf.TaskData(prompt="12*3="))
    real = vf.Trace.model_construct(task=task, rewards={}, metrics={})
    real.record_reward("correct", 1.0, 0.75)  # 1.0 x 0.75 + 0.5 x 0.5 = 1.0
    real.record_reward("format", 0.5, 0.5)
    real.record_metric("turns", 2)
    episode = vf.Episode(task=task, ok=True)
    episode.traces.append(real)
    assert episode_reward(episode) == {"correct": 1.0, "format": 0.5, "turns": 2.0, "reward": 1.0}


def test_the_task_is_the_rows_fields_its_data_class_declares():
    row = {"prompt": "12*34=", "answer": "408", "prompt_id": "arithmetic/train/7", "a": 12, "b": 34}
    task = task_for(ProductsEnv(), row)
    assert isinstance(task, Task)
    assert task.data == TaskData(id="arithmetic/train/7", prompt="12*34=", answer="408")


class Broken(ProductsEnv):
    """Plays by the task's prompt: `raise` raises from run_episode, `fail` returns a failed episode, `unscored` one
    whose rubric did not run, `ok` one scored 1 that checks the session key it was handed."""

    async def run_episode(self, task, ctx):
        kind = task.data.prompt
        if kind == "raise":
            raise RuntimeError("a bug in the environment")
        if kind == "fail":
            return Episode(ok=False, errors=[Error("ProviderError", "upstream 503")], traces=[Trace()])
        if kind == "unscored":
            return Episode(ok=True, traces=[trace({"correct": None})])
        assert os.environ[ctx.client.api_key_var]  # the session's key, under a variable of the episode's own
        assert ctx.client.api_key_var.startswith(KEY_VARIABLE_PREFIX) and ctx.client.base_url.endswith("/v1")
        return Episode(ok=True, traces=[trace({"correct": (1.0, 1.0)})])


def load_broken():
    return Broken()


@pytest.fixture
def runner(tmp_path):
    runner, book = start_runner(tmp_path, VerifiersAgent("tests.test_verifiers_env:load_broken"), timeout_s=5.0)
    yield runner, book
    runner.close()
    runner.server.stop()


def play(runner, book, kinds: list[str]) -> list[tuple[str, str]]:
    import time

    for kind in kinds:
        runner.start(f"lease-{kind}", Prompt(prompt_id=f"p/{kind}", prompt_token_ids=[1], prompt_text=kind,
                                             answer="1"))
    deadline = time.monotonic() + 60
    out: list = []
    while len(out) < len(kinds) and time.monotonic() < deadline:
        out += [(g.group_id, "trained") for g in book.take_groups()] + book.take_dropped()
        time.sleep(0.05)
    return sorted(out)


def test_failed_episodes_leave_their_sessions_untrained_counted_and_the_runner_goes_on(runner):
    runner, book = runner
    outcomes = play(runner, book, ["raise", "fail", "unscored", "ok"])
    # "ok" has two rewarded sessions but no call: the group has no sample, dropped by size (not the adapter's)
    assert [group for group, _ in outcomes] == ["lease-fail", "lease-ok", "lease-raise", "lease-unscored"]
    report = runner.report()
    # 2 sessions per group: raise -> 2 agent errors; fail and unscored -> 2 no-reward each; ok -> 2 rewards
    assert report["agent_errors"] == 2 and report["agent_no_reward"] == 4 and report["agent_rewards"] == 2
    assert report["verifiers_episodes"] == 6 and report["verifiers_failed"] == 2 and report["verifiers_unscored"] == 2
    assert not [k for k in os.environ if k.startswith(KEY_VARIABLE_PREFIX)]  # each episode's key is removed


def not_an_environment():
    return object()


def test_a_loader_that_returns_no_environment_raises_naming_the_setting():
    import asyncio

    agent = VerifiersAgent("tests.test_verifiers_env:not_an_environment")
    with pytest.raises(ValueError, match="gateway.verifiers_env=.* without run_episode, serving, taskset"):
        asyncio.run(agent({"prompt": "1*2=", "answer": "2", "prompt_id": "x"}, "http://127.0.0.1:9/v1", "k"))


BASE = ["gateway.enabled=true", "data.format=arithmetic", "model.path=unused"]


def test_the_setting_needs_the_endpoint_and_is_the_only_agent():
    cfg = load_config(None, [*BASE, "gateway.verifiers_env=demos.products_vf_env:load_environment"])
    assert cfg.gateway.verifiers_env == "demos.products_vf_env:load_environment"
    with pytest.raises(ValueError, match="gateway.enabled=true"):
        load_config(None, ["gateway.verifiers_env=demos.products_vf_env:load_environment", "model.path=unused"])
    with pytest.raises(ValueError, match="leave one of them empty"):
        load_config(None, [*BASE, "gateway.verifiers_env=demos.products_vf_env:load_environment",
                           "gateway.agent=demos.products_agent:run"])
    with pytest.raises(ValueError, match="outside_only=false"):
        load_config(None, [*BASE, "gateway.verifiers_env=demos.products_vf_env:load_environment",
                           "gateway.outside_only=true", "train.eval_every=0"])
    with pytest.raises(ValueError, match="verifiers_env"):
        load_config(None, [*BASE, "gateway.verifiers_env=not a target"])


def test_the_demo_environment_loads():
    env = load_environment()
    assert type(env.taskset).task_type() is Task and Task.data_type() is TaskData


ALTERNATE: list[int] = []


class Alternating(ProductsEnv):
    """The demo environment with a rubric that alternates 0, 1 in the order episodes are scored (the random
    model's answers are never right, and a group whose rewards are equal is dropped), named as verifiers names
    its rewards."""

    @staticmethod
    def _score(trace, data, answer):
        ALTERNATE.append(1)
        trace.record_reward("correct_answer", float(len(ALTERNATE) % 2))


def load_alternating():
    return Alternating()


@pytest.mark.slow
def test_a_run_trains_the_episodes_of_a_verifiers_environment(ray_cluster, tmp_path):
    from tests.test_agent_training import expected_sample, run_agent_job

    # with PPO's critic: the environment's session groups pass the scoring stage like any other group
    summary, trained, records, _ = run_agent_job(
        tmp_path, "gateway.verifiers_env=tests.test_verifiers_env:load_alternating", "algorithm.preset=ppo",
        "critic.num_workers=1")
    assert summary["steps"] == 2 and len(trained) == 4  # 2 steps x 2 prompts
    for group in trained:
        assert len(group.trajectories) == 2
        for t in group.trajectories:
            record = records[t.prompt.metadata["episode"].removeprefix("session/")]
            assert record["group_id"] == group.group_id and record["trained"] and len(record["samples"]) == 1
            # the environment's first message is the task's prompt (the data loader's `A*B=`)
            first = record["calls"][0]["messages"][0]
            assert first["role"] == "user" and re.fullmatch(r"\d{3,4}\*\d{3,4}=", first["content"])
            want = expected_sample(record)
            assert t.prompt.prompt_token_ids == want["prompt"] and t.response_token_ids == want["response"]
            assert t.loss_mask == want["loss_mask"] and t.behavior_logprobs == want["logprobs"]
            # the reward is the rubric's: its one named reward (weight 1), kept as info beside the metric
            assert t.reward == record["reward"] == record["info"]["correct_answer"] in (0.0, 1.0)
            assert record["info"]["num_tool_calls"] >= 0
    # PPO's critic valued both batches and took an update on each
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["critic/version"] for r in rows] == [1.0, 2.0] and all(r["critic/value_loss"] >= 0 for r in rows)
    report = summary["rollout"][0]["gateway"]
    assert report["verifiers_episodes"] >= 8 and report["verifiers_failed"] == 0 and report["agent_errors"] == 0
