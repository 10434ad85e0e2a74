"""How a model's tool call is read and how a tool's output goes back to it (the contract of protocols/tools.py).

The agent loop (actors/agent_loop.py) calls `parse_call` on the text of each model turn that ended, runs the call
with rewards/tools.py ToolBox, and appends what `render_output` returns as a tool segment. The engine stops a turn
at `stop_strings(cfg)`. Pure functions: no tool runs here.
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from protocols.tools import ToolsConfig

_NAME = re.compile(r"[A-Za-z_][\w.-]*")
"""A tool name is a word: the same rule as tools.custom's names (protocols/tools.py)."""


@dataclass(frozen=True)
class ParsedCall:
    """A well-formed call. The name may still be unknown: the ToolBox answers that with `unknown_tool`."""

    name: str
    arguments: str
    """The argument text handed to the tool (surrounding whitespace removed)."""


@dataclass(frozen=True)
class MalformedCall:
    """The turn ended at `call_end` but the call cannot be read: the turn ends as a plain response (counted)."""

    reason: str


class Tokenizer(Protocol):
    """What rendering needs of a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass(frozen=True)
class RenderedOutput:
    """A tool's output as the tool segment the model reads next."""

    token_ids: list[int]
    """The rendered text, tokenized once without special tokens: the segment's tokens."""
    text: str
    """`output_template` with the (possibly cut) output in place of `{output}`."""
    truncated: bool
    """The output had more than tools.max_output_tokens tokens and was cut there."""
    output: str = ""
    """The output as it went into the template (after the cut): what ToolCall.output records."""


def stop_strings(cfg: ToolsConfig) -> list[str]:
    """Engine stop strings for a tool-using rollout: a turn ends right after a call's closing tag (kept in the
    output with `include_stop_str_in_output=True`, so the model's tokens are taken as sampled)."""
    return [cfg.call_end]


def parse_call(turn_text: str, cfg: ToolsConfig) -> ParsedCall | MalformedCall | None:
    """Read the call at the end of a model turn.

    None: the turn did not end at `cfg.call_end` (a plain answer; the sample is finished). Otherwise the body is
    the text between the last `call_start` and that `call_end`, either `NAME:ARGUMENTS` (split at the first
    colon, so the arguments may hold colons) or a JSON object `{"name": ..., "arguments": ...}`. A body that is
    neither gives a `MalformedCall` naming why.
    """
    text = turn_text.rstrip()
    if not text.endswith(cfg.call_end):
        return None
    end = len(text) - len(cfg.call_end)
    start = text.rfind(cfg.call_start, 0, end)
    if start < 0:
        return MalformedCall(f"{cfg.call_end!r} with no {cfg.call_start!r} before it")
    body = text[start + len(cfg.call_start): end].strip()
    if not body:
        return MalformedCall("empty call")
    if body.startswith("{"):
        return _parse_json(body)
    name, colon, arguments = body.partition(":")
    name = name.strip()
    if not colon:
        return MalformedCall(f"no `:` after the tool name in {_preview(body)}")
    if not _NAME.fullmatch(name):
        return MalformedCall(f"tool name {_preview(name)} is not a word (letters, digits, _ . -)")
    return ParsedCall(name, arguments.strip())


def _parse_json(body: str) -> ParsedCall | MalformedCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedCall(f"bad JSON ({err.msg} at character {err.pos})")
    name = call.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name.strip()):
        return MalformedCall(f"the JSON call's `name` {_preview(name)} is not a word")
    return ParsedCall(name.strip(), _argument_text(call.get("arguments", "")))


def _argument_text(arguments: Any) -> str:
    """A tool takes text. A string is that text; an object with one string value (`{"code": "..."}`,
    `{"expression": "..."}`, as function-calling models write them) is that value; anything else is its JSON."""
    if isinstance(arguments, str):
        return arguments.strip()
    if isinstance(arguments, dict) and len(arguments) == 1:
        (value,) = arguments.values()
        if isinstance(value, str):
            return value.strip()
    return json.dumps(arguments)


def _preview(value: Any, chars: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= chars else text[: chars - 3] + "..."


def render_output(output: str, cfg: ToolsConfig, tokenizer: Tokenizer) -> RenderedOutput:
    """The tool segment for `output`: the output cut to `cfg.max_output_tokens` tokens (tokenized alone, cut,
    decoded), put into `cfg.output_template` at `{output}` (other braces in the template are literal), and the
    whole rendered text tokenized ONCE without special tokens. Those ids are appended as they are: they are
    never merged with the model's tokens around them."""
    ids = tokenizer.encode(output, add_special_tokens=False)
    truncated = len(ids) > cfg.max_output_tokens
    if truncated:
        output = tokenizer.decode(ids[: cfg.max_output_tokens], skip_special_tokens=False)
    text = cfg.output_template.replace("{output}", output)
    return RenderedOutput(tokenizer.encode(text, add_special_tokens=False), text, truncated, output)
