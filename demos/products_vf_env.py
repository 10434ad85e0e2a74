"""The products task as a verifiers-shaped environment (deploy/configs/demo_verifiers.yaml,
`gateway.verifiers_env: demos.products_vf_env:load_environment`), played through gateway/verifiers_env.py.

It has verifiers 0.4.0's surface (`verifiers.v1.Env`): a `taskset` whose `task_type()` is a `Task` class around a
`TaskData` (pydantic, frozen), `serving()`, and `run_episode(task, ctx) -> Episode` whose traces carry named,
weighted `rewards`, `metrics`, `ok` and `errors`. Its agent is an in-process chat loop on the stock `openai` SDK
pointed at `ctx.client.base_url` with the key in `ctx.client.api_key_var` (verifiers' harnesses reach the model the
same way, through its interception server and `EvalClient`), offering the calculator as an OpenAI function; its
rubric scores the final answer with the arithmetic verifier. verifiers' own harnesses are PEP 723 scripts that
`uv` installs at run time, which this offline machine cannot do (docs/agents.md), hence an environment written here.
"""

import contextlib
import math
import os
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict

from demos.products_agent import MAX_TURNS, TOOLS, http_client, run_tool
from protocols.trajectory import Prompt
from rewards.arithmetic import verify_arithmetic


class TaskData(BaseModel):
    """verifiers.v1.TaskData's fields that this task uses, and its gold answer."""

    model_config = ConfigDict(frozen=True)

    id: str | None = None
    prompt: str | None = None
    answer: str = ""


class Task:
    def __init__(self, data: TaskData) -> None:
        self.data = data

    @classmethod
    def data_type(cls) -> type[TaskData]:
        return TaskData


class Taskset:
    @classmethod
    def task_type(cls) -> type[Task]:
        return Task


@dataclass
class Reward:
    score: float
    weight: float = 1.0

    @property
    def value(self) -> float:
        return self.score * self.weight


@dataclass
class Error:
    type: str
    message: str
    traceback: str = ""


@dataclass
class Trace:
    """One agent's run: its messages, named weighted rewards and unweighted metrics (verifiers.v1.Trace's)."""

    messages: list[dict] = field(default_factory=list)
    rewards: dict[str, Reward | None] = field(default_factory=dict)
    metrics: dict[str, float | None] = field(default_factory=dict)
    ok: bool = False
    errors: list[Error] = field(default_factory=list)

    @property
    def reward(self) -> float:
        return sum(r.value for r in self.rewards.values() if r is not None)

    def record_reward(self, name: str, value: float, weight: float = 1.0) -> None:
        self.rewards[name] = Reward(float(value), float(weight))

    def record_metric(self, name: str, value: float) -> None:
        self.metrics[name] = float(value)


@dataclass
class Episode:
    ok: bool = False
    errors: list[Error] = field(default_factory=list)
    traces: list[Trace] = field(default_factory=list)


def _error(err: Exception) -> Error:
    return Error(type(err).__name__, str(err), traceback.format_exc())


class ProductsEnv:
    """One agent that may call the calculator once, then answers; the rubric: `correct_answer` (weight 1)."""

    def __init__(self) -> None:
        self.taskset = Taskset()

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        yield  # nothing shared: each episode builds its client on the loop's shared HTTP pool

    async def run_episode(self, task: Task, ctx: Any) -> Episode:
        episode = Episode()
        trace = Trace(messages=[{"role": "user", "content": task.data.prompt}])
        episode.traces.append(trace)
        try:
            answer = await self._play(trace, ctx)
            self._score(trace, task.data, answer)
            trace.ok = True
        except Exception as err:  # noqa: BLE001 - verifiers records a failed run on its trace, never raises
            trace.errors.append(_error(err))
        episode.ok = all(t.ok for t in episode.traces)
        return episode

    async def _play(self, trace: Trace, ctx: Any) -> str:
        client = AsyncOpenAI(base_url=ctx.client.base_url, api_key=os.environ[ctx.client.api_key_var],
                             max_retries=5, timeout=120, http_client=http_client())
        calls = 0
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(model=ctx.model, messages=trace.messages, tools=TOOLS)
            message = reply.choices[0].message
            trace.messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                trace.record_metric("num_tool_calls", calls)
                return message.content or ""
            for call in message.tool_calls:
                calls += 1
                trace.messages.append({"role": "tool", "tool_call_id": call.id,
                                       "content": run_tool(call.function.name, call.function.arguments)})
        trace.record_metric("num_tool_calls", calls)
        return ""

    @staticmethod
    def _score(trace: Trace, data: TaskData, answer: str) -> None:
        result = verify_arithmetic(Prompt(prompt_id=data.id or "", prompt_token_ids=[], answer=data.answer), answer)
        trace.record_reward("correct_answer", result.reward if math.isfinite(result.reward) else 0.0)


def load_environment() -> ProductsEnv:
    return ProductsEnv()
