"""OpenEnv-shaped environments as the agent loop's tools (tools.environment): a class whose `reset(**row)` starts
an episode from a prompt's row, whose public typed methods are the tools, and whose reward is an attribute read
when the episode ends (the shape TRL's GRPOTrainer `environment_factory` runs).

The agent loop (actors/agent_loop.py) makes one `Episode` per sample, dispatches the sample's calls to it from its
tool pool, and puts the reward it reads on the trajectory; the reward worker uses it in place of the verifier's
(rewards/scorer.py). Like a tools.custom function, the environment runs in the rollout worker's process, each call
in a thread waited on for tools.timeout_s, so it must be trusted code. Nothing here raises for a bad call.
"""

import inspect
import json
import logging
import math
import time
from typing import Any, Callable

from transformers.utils import get_json_schema

from protocols.data import DataConfig
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt
from rewards.datasets import encode_prompt
from rewards.tool_calls import MAX_JSON_DEPTH, json_depth
from rewards.tools import ToolResult, call_in_thread, load_target

log = logging.getLogger(__name__)

NOT_TOOLS = ("reset", "get_reward")
"""Public methods that are never tools: `reset` starts the episode; `get_reward` is TRL's reward method (name it in
tools.environment_reward to read the reward from it)."""


def load_environment(tools: ToolsConfig) -> type:
    """The class named by tools.environment (`module:ClassName`); a bad name fails the worker's start."""
    cls = load_target("tools.environment", tools.environment, "ClassName")
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise ValueError(f"tools.environment={tools.environment!r} is not a class with a `reset(**row)` method")
    return cls


def tool_methods(cls: type) -> list[str]:
    """The class's tools: its public methods (no leading `_`), `reset` aside, in definition order."""
    return [name for name, member in vars(cls).items()
            if not name.startswith("_") and name not in NOT_TOOLS and inspect.isfunction(member)]


def environment_schemas(cls: type) -> list[dict]:
    """OpenAI function schemas of the class's tools, from their type hints and Google-style docstrings
    (transformers' `get_json_schema`, as TRL builds them). A method without a docstring or a typed argument
    fails here, with transformers' message and the method's name."""
    schemas = []
    for name in tool_methods(cls):
        try:
            schemas.append(get_json_schema(getattr(cls, name)))
        except Exception as err:  # transformers raises its own DocstringParsingException / TypeHintParsingException
            raise ValueError(f"tools.environment: the method {cls.__name__}.{name} cannot be offered as a tool "
                             f"({type(err).__name__}: {err}); give it type hints and a Google-style docstring, "
                             "or make it private (a leading `_`)") from err
    for schema in schemas:
        schema["function"].get("parameters", {}).get("properties", {}).pop("self", None)
    return schemas


def prompt_tools(tools: ToolsConfig) -> list[dict] | None:
    """The schemas the chat template writes into each prompt: the configured tools', and the environment's."""
    schemas = tools.template_tools()
    if not tools.environment or tools.call_format != "hermes":  # the tagged format teaches its calls otherwise
        return schemas
    return [*(schemas or []), *environment_schemas(load_environment(tools))]


def prompt_encoder(data: DataConfig, tools: ToolsConfig, tokenizer: Any) -> Callable[[str], list[int] | None]:
    """A prompt's user text -> its ids as the data loader encodes them (the chat template, data.system_prompt, the
    tools' schemas), None past data.max_prompt_tokens (the engine's context has no room for it): how the agent loop
    puts an environment's reset observation into a sample's prompt."""
    schemas = prompt_tools(tools)

    def encode(text: str) -> list[int] | None:
        ids = encode_prompt(text, data, tokenizer, schemas)
        return ids if len(ids) <= data.max_prompt_tokens else None

    return encode


def reset_row(prompt: Prompt) -> dict[str, Any]:
    """The keyword arguments of `reset`: the prompt's row as the data loader kept it (its text, its gold answer,
    its id, and its metadata fields)."""
    return {"prompt": prompt.prompt_text, "answer": prompt.answer, "prompt_id": prompt.prompt_id,
            **prompt.metadata}


class Episode:
    """One sample's environment instance. `call` and `reward` never raise."""

    def __init__(self, cls: type, prompt: Prompt, tools: ToolsConfig) -> None:
        self.cfg = tools
        self.names = tool_methods(cls)
        self.error = ""
        """Why the episode could not start (the constructor or reset raised); its calls then answer this."""
        self.observation = ""
        """What reset returned, when it was text: the agent loop appends it to the sample's prompt (TRL's
        environment_factory appends it to the last user message)."""
        self.instance: Any = None
        try:
            self.instance = cls()
            observation = self.instance.reset(**reset_row(prompt))
            self.observation = observation if isinstance(observation, str) else ""
        except Exception as err:  # noqa: BLE001 - a broken episode is the sample's, never the worker's
            self.error = f"the environment could not start: {type(err).__name__}: {err}"

    def call(self, name: str, arguments: str) -> ToolResult:
        """Run method `name` in a thread waited on for tools.timeout_s. `arguments` is a JSON object's text, its
        keys the keyword arguments (Hermes calls are); other text goes whole to a method of one parameter (as the
        tagged format's `NAME:ARGUMENTS` calls a one-argument tool)."""
        start = time.perf_counter()
        if self.error:
            return ToolResult(self.error, "exception", time.perf_counter() - start)
        if name not in self.names:
            known = ", ".join(self.names) or "none"
            return ToolResult(f"unknown tool {name!r}; the tools are: {known}", "unknown_tool",
                              time.perf_counter() - start)
        method = getattr(self.instance, name)
        parameters = list(inspect.signature(method).parameters)
        try:
            depth = json_depth(arguments)
            if depth > MAX_JSON_DEPTH:  # refused as bad JSON before the decoder recurses that deep
                raise ValueError(f"nested {depth} levels deep; at most {MAX_JSON_DEPTH}")
            kwargs = json.loads(arguments) if arguments.strip() else {}
        except ValueError as err:
            if len(parameters) != 1 or arguments.lstrip().startswith("{"):
                return ToolResult(f"ValueError: the arguments are not a JSON object ({err})", "exception",
                                  time.perf_counter() - start)
            kwargs = {parameters[0]: arguments}
        if not isinstance(kwargs, dict) and len(parameters) == 1:
            kwargs = {parameters[0]: kwargs if isinstance(kwargs, str) else arguments}  # a JSON string: its text
        if not isinstance(kwargs, dict):
            return ToolResult(f"TypeError: the arguments must be a JSON object, got {type(kwargs).__name__}",
                              "exception", time.perf_counter() - start)
        try:
            inspect.signature(method).bind(**kwargs)
        except TypeError as err:
            return ToolResult(f"TypeError: {name}: {err}", "exception", time.perf_counter() - start)
        result = call_in_thread(method, (), kwargs, self.cfg.timeout_s, f"environment tool {method.__name__}")
        return ToolResult(result.output, result.error, time.perf_counter() - start)

    def reward(self) -> float | None:
        """The episode's reward: the instance's tools.environment_reward attribute (called when it is a method)
        as a float, or None when the
        episode did not start or the attribute is missing, not a number, or not finite (the caller counts it and
        scores 0)."""
        if self.error:
            return None
        value = getattr(self.instance, self.cfg.environment_reward, None)
        if callable(value):  # a method, as TRL's `get_reward`
            try:
                value = value()
            except Exception:  # noqa: BLE001 - counted by the caller and scored 0
                return None
        if not isinstance(value, (int, float)):  # a bool counts as 1 or 0
            try:  # numpy and torch scalars
                value = float(value.item()) if hasattr(value, "item") else None
            except (TypeError, ValueError):
                value = None
        if value is None or not math.isfinite(value):
            return None
        return float(value)
