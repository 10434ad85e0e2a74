"""The in-process agent (gateway.agent, gateway/agent_runner.py) on a real endpoint server and session book, without
an engine: each leased group's sessions carry the lease's id, an agent that returns None, raises, returns a bad
reward or runs past its time leaves its session untrained and is counted by kind, and the group's drop comes back
by reason; a stop cancels the groups in play and their late outcome is ignored. (Trained groups, with the engine,
are tests/test_agent_training.py's.)"""

import asyncio
import time

import httpx
import pytest

from gateway.agent_runner import AgentRunner, load_agent, task_row
from gateway.chat_render import ChatRenderer
from gateway.engine_bridge import CallInbox
from gateway.server import GatewayServer, ServeSettings
from gateway.sessions import SessionBook
from protocols.trajectory import Prompt
from tests.tiny_chat_tokenizer import build_chat_tokenizer

SEEN: list[dict] = []


async def agent(task, base_url, api_key):
    """Does what the task's prompt says; records what it was given."""
    SEEN.append({"task": task, "base_url": base_url})
    kind = task["prompt"]
    if kind == "raise":
        raise RuntimeError("a bug in the agent")
    if kind == "slow":
        await asyncio.sleep(60)
    if kind == "bad":
        return "high"
    if kind == "reward":
        # the session is live on the endpoint, and its key selects it
        async with httpx.AsyncClient() as client:
            r = await client.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"})
        return {"reward": 1.0, "correct": True} if r.status_code == 200 else None
    return None


def plain_function(task, base_url, api_key):
    return 1.0


def start_runner(tmp_path, agent, timeout_s: float) -> tuple[AgentRunner, SessionBook]:
    """An agent runner on a served session book of groups of 2, with no engine behind it (no call is answered)."""
    book = SessionBook(ChatRenderer(build_chat_tokenizer(tmp_path)), "extend", max_sessions=64, timeout_s=30.0,
                       train_group_size=2)
    settings = ServeSettings(model_name="relayrl", max_tokens=8, max_model_len=64, max_calls_in_flight=4,
                             retry_after_s=1)
    server = GatewayServer(book, CallInbox(lambda max_tokens, options: None), settings).start()
    return AgentRunner(agent, server, book, group_size=2, timeout_s=timeout_s), book


@pytest.fixture
def runner(tmp_path):
    runner, book = start_runner(tmp_path, "tests.test_agent_runner:agent", timeout_s=0.5)
    yield runner, book
    runner.close()
    runner.server.stop()


def prompt(kind: str) -> Prompt:
    return Prompt(prompt_id=f"arithmetic/train/{kind}", prompt_token_ids=[1, 2], prompt_text=kind, answer="42",
                  metadata={"a": 6, "b": 7})


def wait_dropped(book, count: int) -> dict[str, str]:
    out: dict[str, str] = {}
    deadline = time.monotonic() + 20
    while len(out) < count and time.monotonic() < deadline:
        out.update(book.take_dropped())
        time.sleep(0.05)
    return out


def test_failed_runs_leave_their_sessions_untrained_counted_by_kind(runner):
    runner, book = runner
    SEEN.clear()
    kinds = ["none", "raise", "bad", "slow", "reward"]
    for kind in kinds:
        runner.start(f"g-{kind}", prompt(kind))
    assert runner.in_flight == 5
    dropped = wait_dropped(book, 5)
    # each group's 2 sessions carry the lease's id; no group trains: four lack rewards, and the rewarded one made
    # no call, so it holds 0 samples where the learner takes 2
    assert dropped == {"g-none": "sessions_untrained", "g-raise": "sessions_untrained",
                       "g-bad": "sessions_untrained", "g-slow": "sessions_untrained",
                       "g-reward": "group_wrong_size"}
    assert book.take_groups() == []
    assert all(runner.claim(g) for g in dropped) and runner.in_flight == 0
    assert not runner.claim("g-none")  # claimed once
    report = runner.report()
    # 5 groups x 2 runs; 2 runs of each kind
    assert (report["agent_runs"], report["agent_groups"]) == (10, 5)
    assert (report["agent_no_reward"], report["agent_errors"], report["agent_bad_rewards"],
            report["agent_timeouts"], report["agent_rewards"]) == (2, 2, 2, 2, 2)
    assert (book.counts["sessions"], book.counts["sessions_rewarded"], book.counts["sessions_no_reward"]) == (10, 2, 8)
    assert book.open_sessions == 0  # 10 created - 2 rewarded - 8 without reward
    # the task is the prompt's row; each run has a session of its own
    assert SEEN[0]["task"] == {"prompt": "none", "answer": "42", "prompt_id": "arithmetic/train/none", "a": 6, "b": 7}
    assert len({s["base_url"] for s in SEEN}) == 10


def test_a_stop_cancels_the_groups_in_play_and_ignores_their_late_outcome(runner):
    runner, book = runner
    runner.timeout_s = 60.0
    runner.start("g-stopped", prompt("slow"))
    time.sleep(0.3)
    assert runner.abort() == ["g-stopped"] and runner.in_flight == 0
    # the cancelled runs finish their sessions untrained; the group's drop still comes, and is ignored
    assert wait_dropped(book, 1) == {"g-stopped": "sessions_untrained"}
    assert not runner.claim("g-stopped")
    assert runner.report()["agent_groups_after_stop"] == 1


def test_a_group_the_endpoint_has_no_room_for_comes_back_dropped(runner):
    runner, book = runner
    book.max_sessions = 1  # a group of 2 sessions does not fit: none is opened
    runner.start("g-full", prompt("reward"))
    assert wait_dropped(book, 1) == {"g-full": "sessions_refused"}
    assert runner.claim("g-full") and runner.in_flight == 0
    assert (runner.report()["agent_groups_refused"], book.counts["sessions"]) == (1, 0)


def test_the_agent_setting_must_name_an_async_function():
    assert load_agent("tests.test_agent_runner:agent") is agent
    with pytest.raises(ValueError, match="not an async function"):
        load_agent("tests.test_agent_runner:plain_function")
    with pytest.raises(ValueError, match="gateway.agent='tests.test_agent_runner:nothing' could not be loaded"):
        load_agent("tests.test_agent_runner:nothing")


def test_the_task_is_the_prompts_row():
    assert task_row(prompt("x")) == {"prompt": "x", "answer": "42", "prompt_id": "arithmetic/train/x", "a": 6, "b": 7}
