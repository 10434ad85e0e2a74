"""The tool contract: which tools a model may call while it reasons, how it calls them, and the budgets.

With no tool configured a rollout is single-turn, as before. With tools, a sample is a sequence of turns: the
model writes a call, generation stops at the call's closing tag (a stop string, kept in the model's segment), the
rollout worker runs the tool in a pool beside the engine, renders its output with `output_template`, tokenizes
that once and appends it as context (a tool segment that never trains), and the sample continues as a new request
on its exact token prefix. The call format, with the default tags:

    <tool_call>calculator:123*4567</tool_call><tool_response>561741</tool_response>

The text between the tags is `NAME:ARGUMENTS` (the tool's name, a colon, then its argument text as is, e.g. a
Python program), or a JSON object `{"name": ..., "arguments": ...}` as Hermes/Qwen2.5 tool calls are written.

`call_format: hermes` is the model's own format instead, as the session endpoint (gateway/) serves it: the prompt
holds the tools' schemas (`apply_chat_template(tools=...)`), a turn ends at the model's end of turn, its
`<tool_call>` JSON calls are read as vLLM's hermes parser reads them, and their outputs go back as `tool`
messages rendered by the chat template.
"""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BUILTIN_TOOLS = ("python", "calculator")
"""`python` runs the arguments as a program in the code verifier's sandbox, with its limits (reward.code_sandbox),
and returns its stdout (or the error); `calculator` evaluates an arithmetic expression (+ - * / // % ** and
parentheses over integers and decimals) and returns its value."""


TOOL_DESCRIPTIONS = {
    "python": "Run a Python program and return what it prints.",
    "calculator": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return its value.",
}
ARGUMENT_NAMES = {"python": "code", "calculator": "expression"}
"""The one argument of each built-in tool's schema (a user tool's is `input`)."""


class ToolsConfig(BaseModel):
    """Tools the policy may call during a rollout (tool-integrated reasoning). None configured: single-turn."""

    model_config = ConfigDict(extra="forbid")

    builtin: list[Literal["python", "calculator"]] = Field(default_factory=list)
    """Built-in tools offered to the model, by name."""

    custom: dict[str, str] = Field(default_factory=dict)
    """User tools, name -> `module:function`. The function takes the call's argument text (str) and returns the
    output text (str); it runs in a worker thread of the rollout worker's process with tools.timeout_s, so it
    must be safe to run there (use the `python` tool for untrusted code)."""

    environment: str = ""
    """An OpenEnv-shaped environment, `module:ClassName` (rewards/environment.py): each sample gets its own
    instance, `reset(**row)` is called with its prompt's row, its public typed methods with Google-style
    docstrings are tools (their schemas from transformers' `get_json_schema`), and its reward attribute
    (environment_reward) replaces the verifier's reward. Meant for call_format=hermes (JSON arguments become
    keyword arguments, the schemas go into the prompt); in the tagged format a call's argument text goes whole to
    a one-parameter method. Runs in the rollout worker's process like tools.custom, so it must be trusted code.
    Empty: none."""

    environment_reward: str = Field("reward", pattern=r"^[A-Za-z_]\w*$")
    """The environment's attribute read as the episode's reward when the sample ends (a method, as TRL's
    `get_reward`, is called). A missing, non-numeric or non-finite value is counted (the worker's `tools` report,
    `environment_bad_rewards`) and scored 0."""

    call_format: Literal["tagged", "hermes"] = "tagged"
    """How a call is written: `tagged` is `call_start` NAME:ARGUMENTS `call_end` (see the module docstring);
    `hermes` is Qwen2.5/Qwen3's own format through the model's chat template, which must support tools (the
    tags and output_template are then the template's, and these fields are unused)."""

    call_start: str = Field("<tool_call>", min_length=1)
    """Text that opens a call."""

    call_end: str = Field("</tool_call>", min_length=1)
    """Text that closes a call: the engine stops there (a stop string kept in the output), and the tool runs."""

    output_template: str = "<tool_response>{output}</tool_response>"
    """Wraps a tool's output (or its error text) before it is tokenized, once, without special tokens, and
    appended as context. Must contain `{output}` once."""

    max_turns: int = Field(4, ge=1, le=256)
    """Model turns per sample, the final answer's included (so at most max_turns - 1 tool calls). A sample that
    still calls a tool on its last turn ends there, marked truncated (finish reason `max_turns`)."""

    timeout_s: float = Field(10.0, gt=0, le=3600)
    """Wall seconds a tool call may run; past it the call's output is the timeout's error text."""

    max_output_tokens: int = Field(64, ge=1, le=1_000_000)
    """Tokens of a tool's output kept (before the template is applied); a longer output is cut there, counted
    in `tools/truncated_outputs` and flagged on the call. The whole sample's tokens, tool segments included,
    share one budget: rollout.max_response_tokens."""

    pool_size: int = Field(4, ge=1, le=1024)
    """Tool calls a rollout worker runs at once, beside its engine (the engine keeps decoding the other samples
    while they run)."""

    @property
    def enabled(self) -> bool:
        return bool(self.builtin or self.custom or self.environment)

    @property
    def names(self) -> list[str]:
        return [*self.builtin, *self.custom]

    def template_tools(self) -> list[dict] | None:
        """The schemas the chat template writes into each prompt: in the hermes format only (the tagged format
        teaches its calls otherwise)."""
        return self.schemas() if self.enabled and self.call_format == "hermes" else None

    def schemas(self) -> list[dict]:
        """The tools as OpenAI function schemas, for the chat template (`call_format: hermes`): each takes one
        string argument, which becomes the tool's argument text. An environment's schemas come from its class
        (rewards/environment.py prompt_tools adds them; protocols/ does not import transformers)."""
        return [{"type": "function", "function": {
            "name": name, "description": TOOL_DESCRIPTIONS.get(name, f"The user tool `{name}`."),
            "parameters": {"type": "object", "properties": {ARGUMENT_NAMES.get(name, "input"): {"type": "string"}},
                           "required": [ARGUMENT_NAMES.get(name, "input")]}}} for name in self.names]

    @field_validator("custom")
    @classmethod
    def _check_custom(cls, custom: dict[str, str]) -> dict[str, str]:
        for name, target in custom.items():
            if not re.fullmatch(r"[A-Za-z_][\w.-]*", name) or name in BUILTIN_TOOLS:
                raise ValueError(
                    f"tools.custom has a tool named {name!r}: a name is a word (letters, digits, _ . -) other than "
                    f"the built-in {list(BUILTIN_TOOLS)}; rename it")
            if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", target):
                raise ValueError(
                    f"tools.custom.{name}={target!r} must be `module:function` (e.g. `my_tools.search:run`)")
        return custom

    @model_validator(mode="after")
    def _check_environment(self) -> "ToolsConfig":
        if self.environment and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", self.environment):
            raise ValueError(f"tools.environment={self.environment!r} must be `module:ClassName` "
                             "(e.g. `my_envs.counter:CounterEnv`)")
        return self

    @model_validator(mode="after")
    def _check_template(self) -> "ToolsConfig":
        if self.output_template.count("{output}") != 1:
            raise ValueError(
                f"tools.output_template={self.output_template!r} must contain `{{output}}` exactly once: it is "
                "where the tool's output goes")
        return self
