"""A run fed by an in-process agent (gateway.agent) on its own data set, distilled from a teacher: the rollout
worker plays each prompt it leases with the agent, written with the stock `openai` SDK, `samples_per_prompt` times
in sessions of its own endpoint; the groups trained are those sessions' episodes under the leased ids, each sample exactly the tokens the
engine saw and sampled (the endpoint's record of each call), with loss on the sampled tokens only.

And a run fed by outside agents alone (gateway.outside_only): no data set, no leases; a thread and the example
agent program (demos/outside_agent.py, a process of its own) open sessions from RUN/gateway/endpoints.json, and
every trained group is theirs, each sample again exactly the endpoint's records."""

import itertools
import json
import logging
import os
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from cluster.trainer import Trainer
from demos.agent_task import CALCULATOR_SCHEMA
from gateway.sessions import SESSION_GROUP_PREFIX
from protocols.config import load_config
from protocols.data import DataConfig
from rewards.datasets import encode_prompt
from tests.conftest import REPO, record_batches

pytestmark = pytest.mark.slow


RUNS = itertools.count()


async def agent(task, base_url, api_key):
    """Two calls: the task, then a calculator result after the reply. The reward alternates 0, 1 in the order the
    runs start (a group's runs start one after the other), so a group's rewards differ and no group is dropped for
    zero variance: the random model's replies say nothing."""
    reward = float(next(RUNS) % 2)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    try:
        messages = [{"role": "user", "content": task["prompt"]}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA])
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "call_0", "content": task["answer"]}]
        second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA])
    finally:
        await client.close()
    assert first.choices[0].message.role == second.choices[0].message.role == "assistant"
    return {"reward": reward, "correct": False}


def run_agent_job(tmp_path, agent_setting: str, *extra: str) -> tuple[dict, list, dict[str, dict], str]:
    """A 2-step GRPO run on the products task whose groups an in-process agent plays (`agent_setting`:
    `gateway.agent=...` or `gateway.verifiers_env=...`; `extra`: more settings, which win) -> (summary, the
    trained groups, the endpoint's episode records by session id, the model folder)."""
    from demos.arithmetic_model import build_random_model
    from protocols.tools import ToolsConfig

    model = build_random_model(tmp_path / "model", tied=False, seed=1,
                               tools=ToolsConfig(builtin=["calculator"], call_format="hermes"))
    cfg = load_config(None, [
        f"output_dir={tmp_path / 'run'}", f"model.path={model}", "model.dtype=float32", "cluster.use_gpus=false",
        "data.format=arithmetic", "data.arithmetic_op=\"*\"", "data.arithmetic_min_operand=100",
        "data.arithmetic_max_operand=9999", "data.arithmetic_num_train=64", "data.num_eval_prompts=4",
        "data.max_prompt_tokens=24", "tools.builtin=[calculator]", "tools.call_format=hermes", "tools.max_turns=2",
        "gateway.enabled=true", agent_setting, "gateway.max_tokens=6",
        "rollout.num_workers=1", "rollout.max_response_tokens=24", "rollout.gpu_memory_utilization=0.1",
        "rollout.max_num_seqs=16", "rollout.prompts_in_flight=4", "rollout.enforce_eager=true",
        "rollout.samples_per_prompt=2", "reward.num_workers=1", "reward.num_processes=1", "learner.num_ranks=1",
        "learner.zero_stage=2", "learner.prompts_per_step=2", "learner.micro_batch_size=4",
        "learner.gradient_checkpointing=false", "algorithm.preset=grpo", "train.steps=2", "train.max_staleness=4",
        "train.eval_every=0", "train.save_every=0", "weight_sync.verify_every=0", *extra])
    trainer = Trainer(cfg)
    batches = record_batches(trainer)
    try:
        summary = trainer.run()
    finally:
        trainer.shutdown()
    trained = [g for _, groups in batches for g in groups]
    records = {}
    for line in (tmp_path / "run" / "gateway" / "episodes-worker-0.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["session_id"]] = record
    return summary, trained, records, str(model)


def test_a_run_trains_the_groups_its_in_process_agent_plays(ray_cluster, tmp_path):
    # distilled from a teacher: the agent's session groups pass the scoring stage like any other group
    teacher = hermes_model(tmp_path / "teacher", seed=2)
    summary, trained, records, model = run_agent_job(
        tmp_path, "gateway.agent=tests.test_agent_training:agent", f"teacher.path={teacher}", "teacher.num_workers=1",
        "algorithm.distillation.weight=0.5")
    assert summary["steps"] == 2 and len(trained) == 4  # 2 steps x 2 prompts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for group in trained:
        # the leased group itself (not an endpoint-made group), of the learner's size
        assert not group.group_id.startswith(SESSION_GROUP_PREFIX) and len(group.trajectories) == 2
        for t in group.trajectories:
            record = records[t.prompt.metadata["episode"].removeprefix("session/")]
            assert record["group_id"] == group.group_id and record["trained"]
            first, second = record["calls"]
            # the first prompt is the data loader's for the task (the same template, with the tools)
            task = first["messages"][0]["content"]
            assert first["prompt_ids"] == encode_prompt(task, DataConfig(format="arithmetic"), tokenizer,
                                                        [CALCULATOR_SCHEMA])
            # one sample: the first call's prompt; its sampled ids, the inserted ids, the second call's sampled ids
            inserted = second["prompt_ids"][len(first["prompt_ids"]) + len(first["sampled_ids"]):]
            assert second["prompt_ids"] == [*first["prompt_ids"], *first["sampled_ids"], *inserted]
            assert t.prompt.prompt_token_ids == first["prompt_ids"]
            assert t.response_token_ids == [*first["sampled_ids"], *inserted, *second["sampled_ids"]]
            assert t.loss_mask == [True] * len(first["sampled_ids"]) + [False] * len(inserted) + \
                [True] * len(second["sampled_ids"])
            assert t.behavior_logprobs == [*first["behavior_logprobs"], *[0.0] * len(inserted),
                                           *second["behavior_logprobs"]]
            assert t.reward == record["reward"]
            # the teacher scored every response token (the endpoint's sampled and inserted ones alike)
            assert len(t.teacher_logprobs) == len(t.response_token_ids)
            assert all(lp <= 0.0 for lp in t.teacher_logprobs)
    report = summary["rollout"][0]["gateway"]
    assert report["agent_rewards"] >= 8 and report["agent_errors"] == 0 and report["agent_groups"] >= 4


def hermes_model(folder, seed: int = 1):
    from demos.arithmetic_model import build_random_model
    from protocols.tools import ToolsConfig

    return build_random_model(folder, tied=False, seed=seed, tools=ToolsConfig(builtin=["calculator"],
                                                                               call_format="hermes"))


def endpoints(run_dir, stop: threading.Event) -> dict | None:
    """RUN/gateway/endpoints.json once the run serves (None if `stop` came first)."""
    path = run_dir / "gateway" / "endpoints.json"
    while not stop.is_set():
        if path.is_file() and (data := json.loads(path.read_text()))["ready"]:
            return data
        stop.wait(0.2)
    return None


def two_call_episode(session: dict, task: int) -> None:
    """The task, then a `tool` message after the reply: two calls that extend each other (one sample)."""
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=120)
    messages = [{"role": "user", "content": f"{100 + task}*{200 + task}="}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA])
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": "call_0", "content": str((100 + task) * (200 + task))}]
    client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA])


def reward(url: str, session: dict, value) -> int:
    return httpx.post(f"{url}/sessions/{session['session_id']}/reward", json={"reward": value},
                      headers={"Authorization": f"Bearer {session['api_key']}"}).status_code


def strays(url: str) -> None:
    """Sessions that must not train, each counted: a group whose second session ends with no reward (one sample
    where the group needs two), a group of two sessions with no call and no reward, a group left half open."""
    s = [httpx.post(f"{url}/sessions", json={"group": key}).json() for key in ("stray-1", "stray-1", "stray-2",
                                                                                 "stray-2", "stray-3")]
    two_call_episode(s[0], 0)
    two_call_episode(s[1], 0)
    assert reward(url, s[0], 1.0) == 200
    for session in s[1:4]:
        assert httpx.post(f"{url}/sessions/{session['session_id']}/finish",
                          headers={"Authorization": f"Bearer {session['api_key']}"}).status_code == 200
    assert reward(url, s[1], 1.0) == 410  # finished: too late
    two_call_episode(s[4], 1)
    assert reward(url, s[4], 0.0) == 200  # its group's second session never comes


def outside_agents(run_dir, stop: threading.Event, waited: threading.Event, played: list, script: list) -> None:
    """The strays, then (once the driver has logged that it waits for outside agents) the example agent program
    for one group, and groups of two two-call sessions with rewards 1 and 0 until the run ends."""
    found = endpoints(run_dir, stop)
    if found is None:
        return
    url = found["workers"][0]["url"]
    assert found["outside_only"] and found["group_size"] == 2
    strays(url)
    waited.wait(300)
    script.append(subprocess.Popen(
        [sys.executable, str(REPO / "demos" / "outside_agent.py"), str(run_dir), "--tasks", "1", "--concurrency", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}))
    # the thread's groups start once the program's group is in: four of the thread's alone would end the run's two
    # steps, and a loaded machine can start the program (Python, the SDK) slower than that
    try:
        script[0].wait(timeout=300)
    except subprocess.TimeoutExpired:
        pass  # its assertions below say what it printed
    for task in itertools.count(2):
        if stop.is_set():
            return
        try:
            sessions = [httpx.post(f"{url}/sessions", json={"group": f"thread-{task}"}).json() for _ in range(2)]
            for session in sessions:
                two_call_episode(session, task)
            for session, value in zip(sessions, (1.0, 0.0)):
                reward(url, session, value)
            played.append(task)
        except (httpx.HTTPError, openai.OpenAIError):  # the run ended under a call
            return


class WaitLine(logging.Handler):
    """Sets `event` when the driver logs a wait that names gateway.outside_only."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__(logging.WARNING)
        self.event, self.lines = event, []

    def emit(self, record: logging.LogRecord) -> None:
        if "gateway.outside_only" in record.getMessage():
            self.lines.append(record.getMessage())
            self.event.set()


def expected_sample(record: dict) -> dict:
    """An unsplit episode's one sample from its per-call records: the first call's prompt; then everything the
    last call's prompt and sampled ids hold, with loss, log-probs and versions only where a call sampled."""
    calls = record["calls"]
    first, last = calls[0], calls[-1]
    response = [*last["prompt_ids"], *last["sampled_ids"]][len(first["prompt_ids"]):]
    mask, logprobs, versions = [False] * len(response), [0.0] * len(response), [-1] * len(response)
    for call in calls:
        start = len(call["prompt_ids"]) - len(first["prompt_ids"])
        for k, (lp, v) in enumerate(zip(call["behavior_logprobs"], call["token_versions"])):
            mask[start + k], logprobs[start + k], versions[start + k] = True, lp, v
        assert response[start:start + len(call["sampled_ids"])] == call["sampled_ids"]
    return {"prompt": first["prompt_ids"], "response": response, "loss_mask": mask, "logprobs": logprobs,
            "versions": versions}


def test_a_run_fed_by_outside_agents_alone_trains_only_their_groups(ray_cluster, tmp_path):
    model = hermes_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    cfg = load_config(None, [
        f"output_dir={run_dir}", f"model.path={model}", "model.dtype=float32", "cluster.use_gpus=false",
        "data.max_prompt_tokens=64", "gateway.enabled=true", "gateway.outside_only=true", "gateway.max_tokens=6",
        "rollout.num_workers=1", "rollout.max_response_tokens=24", "rollout.gpu_memory_utilization=0.1",
        "rollout.max_num_seqs=16", "rollout.enforce_eager=true", "rollout.samples_per_prompt=2",
        "reward.num_workers=1", "reward.num_processes=1", "learner.num_ranks=1", "learner.zero_stage=2",
        "learner.prompts_per_step=2", "learner.micro_batch_size=4", "learner.gradient_checkpointing=false",
        "algorithm.preset=grpo", "train.steps=2", "train.max_staleness=4", "train.save_every=0",
        "weight_sync.verify_every=0", "fault.wait_log_s=1"])
    trainer = Trainer(cfg)
    assert trainer.train_prompts == [] and trainer.eval_prompts == []  # no data set loaded
    batches = record_batches(trainer)
    stop, waited, played, script = threading.Event(), threading.Event(), [], []
    lines = WaitLine(waited)
    logging.getLogger("cluster.supervisor").addHandler(lines)
    player = threading.Thread(target=outside_agents, args=(run_dir, stop, waited, played, script), daemon=True)
    player.start()
    try:
        summary = trainer.run()
    finally:
        stop.set()
        waited.set()
        logging.getLogger("cluster.supervisor").removeHandler(lines)
        trainer.shutdown()
        player.join(120)
    # the example program played its one group and exited once the run had finished
    output, _ = script[0].communicate(timeout=120)
    assert script[0].returncode == 0, output
    assert json.loads(output.strip().splitlines()[-1])["groups"] == 1, output
    assert json.loads((run_dir / "gateway" / "endpoints.json").read_text())["finished"]
    # the driver said what it waited for before any agent had played a group
    assert "0 groups went to training" in lines.lines[0] and "endpoints.json" in lines.lines[0]

    trained = [g for _, groups in batches for g in groups]
    assert summary["steps"] == 2 and len(trained) == 4 and played
    assert all(g.group_id.startswith(SESSION_GROUP_PREFIX) for g in trained)  # nothing leased
    assert sum("/thread-" in g.group_id for g in trained) >= 3  # the program played one group, the thread the rest
    assert summary["accuracy_before"] is None and summary["queue"]["data/epoch"] == 0
    records = {}
    for line in (run_dir / "gateway" / "episodes-worker-0.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["session_id"]] = record
    two_calls = 0
    for group in trained:
        assert len(group.trajectories) == 2 and "/stray-" not in group.group_id
        for t in group.trajectories:
            record = records[t.prompt.metadata["episode"].removeprefix("session/")]
            assert record["group_id"] == group.group_id and record["trained"] and len(record["samples"]) == 1
            want = expected_sample(record)
            assert t.prompt.prompt_token_ids == want["prompt"] and t.response_token_ids == want["response"]
            assert t.loss_mask == want["loss_mask"]  # loss on sampled tokens only
            assert t.behavior_logprobs == want["logprobs"] and t.token_versions == want["versions"]
            assert t.reward == record["reward"]
            two_calls += len(record["calls"]) == 2
    assert two_calls >= 6  # the thread's episodes: two calls, one sample
    report = summary["rollout"][0]["gateway"]
    # the strays: counted, never trained
    assert report["sessions_no_reward"] >= 3 and report["groups_wrong_size"] >= 1
    assert report["groups_untrained"] >= 1 and report["groups_open"] >= 1
    assert report["groups_opened"] == report["groups"] + report["groups_wrong_size"] + \
        report["groups_untrained"] + report["groups_incomplete"] + report["groups_open"]
    queue = summary["queue"]
    # every group admitted arrived from the endpoint: admitted = received (trained, dropped or queued)
    assert queue["queue/admitted"] == queue["queue/received"] >= 4 and queue["queue/trained"] == 4
