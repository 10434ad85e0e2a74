"""Tool calls in the Hermes format that Qwen2.5 and Qwen3 write, read into OpenAI `tool_calls` for the session
endpoint's replies: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, after optional content.

The result is the one vLLM's `hermes` parser gives on the same text (tests/test_hermes_parser.py compares them):
every `<tool_call>` region (the last may be unclosed) must hold a JSON object with a string `name` and an
`arguments` key; the arguments are returned as JSON text (`json.dumps(..., ensure_ascii=False)`); the content is
the text before the first `<tool_call>` (None when empty). If any region fails, the reply is plain content (the
whole text) with no calls, and the failure is named. Bounded as the other parsers of model output are
(rewards/tool_calls.py): a region over MAX_CALL_CHARS or nested deeper than MAX_JSON_DEPTH fails before
`json.loads`, where vLLM would parse the first or fail the second by RecursionError. Linear in the text."""

import json
import sys
from dataclasses import dataclass, field

from rewards.tool_calls import MAX_CALL_CHARS, MAX_JSON_DEPTH, json_depth

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ParsedReply:
    """A model turn as an OpenAI assistant message's `content` and `tool_calls`."""

    content: str | None
    tool_calls: list[dict] = field(default_factory=list)
    """OpenAI tool calls: {"id", "type": "function", "function": {"name", "arguments" (JSON text)}}."""
    error: str = ""
    """Why the turn's calls could not be read (it is then plain content); empty otherwise."""

    def message(self) -> dict:
        """The assistant message (OpenAI JSON)."""
        out = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def parse_hermes(text: str, call_id_prefix: str = "call") -> ParsedReply:
    """Read the Hermes tool calls of a model turn; call ids are `{call_id_prefix}_{i}`."""
    first = text.find(CALL_START)
    if first < 0:
        return ParsedReply(text)
    calls = []
    for i, body in enumerate(_regions(text, first)):
        call = _read_call(body)
        if isinstance(call, str):
            return ParsedReply(text, error=f"tool call {i}: {call}")
        name, arguments = call
        calls.append({"id": f"{call_id_prefix}_{i}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    return ParsedReply(text[:first] or None, calls)


def _regions(text: str, start: int) -> list[str]:
    """The text of each `<tool_call>` region from `start`: up to its `</tool_call>`, or to the end (unclosed)."""
    out = []
    while start >= 0:
        body_at = start + len(CALL_START)
        end = text.find(CALL_END, body_at)
        if end < 0:
            out.append(text[body_at:])
            break
        out.append(text[body_at:end])
        start = text.find(CALL_START, end + len(CALL_END))
    return out


def _read_call(body: str) -> tuple[str, str] | str:
    """(name, arguments as JSON text), or why the region cannot be read."""
    if len(body) > MAX_CALL_CHARS:
        return f"{len(body)} characters; a call has at most {MAX_CALL_CHARS}"
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        return f"JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH}"
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return f"bad JSON ({err.msg} at character {err.pos})"
    except ValueError:
        return f"a number has more than {sys.get_int_max_str_digits()} digits"
    if not isinstance(call, dict) or "name" not in call or "arguments" not in call:
        return 'not a JSON object with "name" and "arguments"'
    if not isinstance(call["name"], str):
        return f"the name is {type(call['name']).__name__}, not a string"
    try:
        arguments = json.dumps(call["arguments"], ensure_ascii=False)  # NaN and Infinity as vLLM's parser writes them
        (call["name"] + arguments).encode("utf-8")
    except UnicodeEncodeError:  # an escape such as \ud800 decodes to a lone surrogate, which no response can carry
        return "the name or arguments hold a lone surrogate (an escape in \\ud800-\\udfff), which is not text"
    except ValueError as err:  # an integer past the int-to-text limit
        return f"arguments cannot be written back as JSON ({err})"
    return call["name"], arguments
