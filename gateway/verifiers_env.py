"""A `verifiers` environment as the run's in-process agent (gateway.verifiers_env): each session the agent runner
opens plays one episode of the environment, whose model calls go to the session's `base_url` as plain OpenAI chat
requests, so the endpoint builds and records every token itself (not verifiers' token route). The episode's rubric
reward is the session's reward.

The shape is verifiers 0.4.0's (`verifiers.v1`): `Env.serving()` holds the environment's serving resources (its
interception server, shared tool servers), `Env.run_episode(task, ModelContext)` plays one task and returns an
`Episode` whose traces carry named, weighted rewards (`Trace.rewards`, `Trace.reward` their weighted sum) and
metrics; `Episode.ok` is false when a hook, an agent or a model call failed. The model's endpoint is an
`EvalClientConfig(base_url, api_key_var)`: the key is read from that environment variable, so each episode puts its
session's key under a variable of its own."""

import asyncio
import contextlib
import logging
import math
import os
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from rewards.tools import load_target

log = logging.getLogger(__name__)

KEY_VARIABLE_PREFIX = "RELAYRL_SESSION_KEY_"
"""The environment variable that holds one episode's session key, for the EvalClientConfig's `api_key_var`."""

COUNTER_NAMES = ("verifiers_episodes", "verifiers_failed", "verifiers_unscored")
"""Episodes played; episodes that failed (`ok` false, or no trace: a hook, an agent or a model call raised); episodes
with a reward that did not score or is not finite. Either leaves its session untrained (`agent_no_reward`)."""


@dataclass(frozen=True)
class LocalClientConfig:
    """`verifiers.v1.EvalClientConfig`'s fields that the adapter sets, where verifiers is not installed."""

    base_url: str
    api_key_var: str
    type: str = "eval"


@dataclass(frozen=True)
class LocalModelContext:
    """`verifiers.v1.ModelContext`'s fields (model, client, sampling), where verifiers is not installed."""

    model: str
    client: LocalClientConfig
    sampling: Any = None


def model_context(model: str, base_url: str, api_key_var: str) -> Any:
    """The `ModelContext` of one episode: verifiers' own types when the package is installed, else the local ones
    of the same fields (a verifiers-shaped environment written without the package reads the same names)."""
    try:
        from verifiers.v1 import EvalClientConfig, ModelContext
    except ImportError:
        return LocalModelContext(model, LocalClientConfig(base_url, api_key_var))
    return ModelContext(model=model, client=EvalClientConfig(base_url=base_url, api_key_var=api_key_var))


def task_for(env: Any, row: dict[str, Any]) -> Any:
    """The environment's task for a prompt's row: its taskset's `Task` class around its `TaskData` class, given the
    row's fields that the data class declares (`prompt_id` as `id`; the rest of the row is dropped unless the data
    class keeps extra fields)."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    fields = {"id": str(row.get("prompt_id", "")), **{k: v for k, v in row.items() if k != "prompt_id"}}
    if getattr(data_cls, "model_config", {}).get("extra") != "allow":
        fields = {k: v for k, v in fields.items() if k in data_cls.model_fields}
    return task_cls(data_cls.model_validate(fields))


def episode_reward(episode: Any) -> dict[str, Any] | None:
    """The session's reward from a finished episode: `{"reward": the traces' summed weighted rewards, <each named
    reward's score>, <each metric>}`; None (not trained) when the episode failed (`ok` false), has no trace, or a
    reward did not score (None) or is not finite. The named values are kept as the sample's info."""
    if not episode.ok or not episode.traces:
        return None
    info: dict[str, float] = {}
    for trace in episode.traces:
        for name, reward in trace.rewards.items():
            if reward is None:  # verifiers: "scoring didn't run"
                return None
            info[name] = float(reward.score)
        info.update({name: float(value) for name, value in trace.metrics.items() if value is not None})
    total = sum(float(trace.reward) for trace in episode.traces)
    if not math.isfinite(total) or not all(math.isfinite(v) for v in info.values()):
        return None
    return {**info, "reward": total}


@dataclass
class VerifiersAgent:
    """The agent function the runner calls per session: `await agent(task, base_url, api_key)`. The environment is
    loaded and its `serving()` entered once, in the agents' event loop, on the first episode (a load that fails
    raises from every episode, each counted as an agent error)."""

    target: str
    """gateway.verifiers_env: `module:function`, a function of no arguments returning the environment."""
    model: str = "policy"
    """The model name the environment's requests carry (the endpoint serves the run's policy whatever it says)."""
    counts: Counter = field(default_factory=lambda: Counter(dict.fromkeys(COUNTER_NAMES, 0)))
    """COUNTER_NAMES, in the worker's `gateway` report beside the runner's `agent_*` counts."""
    env: Any = None
    _serving: contextlib.AsyncExitStack | None = None
    _loading: asyncio.Lock | None = None
    """Made in the agents' loop on the first episode: the group's first episodes wait for one load, not one each."""

    async def __call__(self, task: dict[str, Any], base_url: str, api_key: str) -> dict[str, Any] | None:
        env = await self._environment()
        variable = KEY_VARIABLE_PREFIX + uuid.uuid4().hex
        os.environ[variable] = api_key
        try:
            episode = await env.run_episode(task_for(env, task), model_context(self.model, base_url, variable))
        finally:
            os.environ.pop(variable, None)
        self.counts["verifiers_episodes"] += 1
        reward = episode_reward(episode)
        if reward is None:
            failed = not episode.ok or not episode.traces
            self.counts["verifiers_failed" if failed else "verifiers_unscored"] += 1
            errors = [f"{e.type}: {e.message}" for e in getattr(episode, "errors", [])][-2:]
            log.warning("gateway.verifiers_env=%r: episode on %s %s: %s", self.target, task.get("prompt_id"),
                        "failed" if failed else "has a reward that did not score", errors or "no error recorded")
        return reward

    async def _environment(self) -> Any:
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            if self.env is None:
                env = load_environment(self.target)
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(env.serving())
                self.env, self._serving = env, stack
        return self.env

    async def close(self) -> None:
        if self._serving is not None:
            await self._serving.aclose()
            self._serving, self.env = None, None


def load_environment(target: str) -> Any:
    """The environment gateway.verifiers_env's function returns; it must have `run_episode`, `serving` and a
    `taskset` (verifiers.v1.Env's)."""
    loader: Callable[[], Any] = load_target("gateway.verifiers_env", target, "function")
    env = loader()
    missing = [name for name in ("run_episode", "serving", "taskset") if not hasattr(env, name)]
    if missing:
        raise ValueError(f"gateway.verifiers_env={target!r} returned a {type(env).__name__} without "
                         f"{', '.join(missing)}: return a verifiers Env (verifiers.v1.Env, e.g. from "
                         "verifiers.v1.utils.loaders.load_environment(config))")
    return env
