"""How a model's tool call is read and how a tool's output goes back to it (the contract of protocols/tools.py).

The agent loop (actors/agent_loop.py) calls `parse_call` on the text of each model turn that ended, runs the call
with rewards/tools.py ToolBox, and appends what `render_output` returns as a tool segment. The engine stops a turn
at `stop_strings(cfg)`. The driver's `tools/*` metrics are counted here too (`tool_counts`, `tool_metrics`).
Pure functions: no tool runs here.
"""

import itertools
import json
import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from protocols.tools import ToolsConfig
from protocols.trajectory import Trajectory

_NAME = re.compile(r"[A-Za-z_][\w.-]*")
"""A tool name is a word: the same rule as tools.custom's names (protocols/tools.py)."""
MAX_CALL_CHARS = 100_000
"""A call body longer than this is malformed, unread: far above any program or expression a tool takes, and a
bound on what one call hands to a tool."""
MAX_JSON_DEPTH = 64
"""A JSON call nested deeper than this (arrays and objects) is malformed, refused before `json.loads`: real
arguments are a few levels deep, and a 1,000-deep body would raise RecursionError in the decoder."""
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unterminated one to the end of the text (the decoder refuses it there, so its brackets
never nest): every search that starts at a quote ends in a match, so the scan is linear even for text such as
`\\"` repeated, where a search per quote to the end would be quadratic."""
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")


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
    output with `include_stop_str_in_output=True`, so the model's tokens are taken as sampled). None in the hermes
    format: a turn ends at the model's end of turn, after all its calls."""
    return [] if cfg.call_format == "hermes" else [cfg.call_end]


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
    if len(body) > MAX_CALL_CHARS:
        return MalformedCall(f"call of {len(body)} characters; a call has at most {MAX_CALL_CHARS}")
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
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        return MalformedCall(f"JSON call nested {depth} levels deep; at most {MAX_JSON_DEPTH}")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedCall(f"bad JSON ({err.msg} at character {err.pos})")
    except ValueError:
        # the only other refusal of json.loads: an integer past Python's int-from-text limit
        return MalformedCall(f"a number in the JSON call has more than {sys.get_int_max_str_digits()} digits")
    name = call.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name.strip()):
        return MalformedCall(f"the JSON call's `name` {_preview(name)} is not a word")
    return ParsedCall(name.strip(), argument_text(call.get("arguments", "")))


def json_depth(text: str) -> int:
    """The deepest nesting of `[ ]` and `{ }` in JSON text, brackets inside strings not counted: `{"a": [1]}` is
    2. Linear in the text, and never recursive (it is what keeps the decoder's recursion bounded)."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(1 if b in "[{" else -1 for b in brackets), default=0)


def argument_text(arguments: Any) -> str:
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
    decoded; see `cut_output` for long outputs), put into `cfg.output_template` at `{output}` (other braces in the template are literal), and the
    whole rendered text tokenized ONCE without special tokens. Those ids are appended as they are: they are
    never merged with the model's tokens around them."""
    output, truncated = cut_output(output, cfg.max_output_tokens, tokenizer)
    text = cfg.output_template.replace("{output}", output)
    return RenderedOutput(tokenizer.encode(text, add_special_tokens=False), text, truncated, output)


HEAD_CHARS_PER_TOKEN = 16
BOUNDARY_TOKENS = 16


def cut_output(output: str, cap: int, tokenizer: Tokenizer) -> tuple[str, bool]:
    """(the output's first `cap` tokens as text, whether it had more). A long output (a program may print a MiB)
    is tokenized only as far as its first 16 characters per kept token: when that head alone has more than
    `cap` + 16 tokens, the tokens that could differ from the whole output's (those at the head's cut) lie past the
    kept ones. Otherwise (very long tokens) the whole output is tokenized."""
    head = output[: max(1024, cap * HEAD_CHARS_PER_TOKEN)]
    if len(head) < len(output):
        ids = tokenizer.encode(head, add_special_tokens=False)
        if len(ids) > cap + BOUNDARY_TOKENS:
            return tokenizer.decode(ids[:cap], skip_special_tokens=False), True
    ids = tokenizer.encode(output, add_special_tokens=False)
    if len(ids) <= cap:
        return output, False
    return tokenizer.decode(ids[:cap], skip_special_tokens=False), True


# ----- metrics ----------------------------------------------------------------------------------------------
TOOL_ERRORS = ("unknown_tool", "exception", "timeout")
"""Error kinds of a call, always reported (0 when none happened)."""


def tool_counts(trajectories: Iterable[Trajectory]) -> Counter:
    """Raw counts over samples (they add across steps and runs): samples, turns, calls, calls_error_<kind>,
    call_seconds, tool_tokens, response_tokens, truncated_outputs, malformed_calls, max_turns.

    A malformed call leaves no tool segment: the sample ends at it as a plain response (finish reason `stop`),
    marked `malformed_call` by the agent loop, which parsed it once; nothing is parsed again here."""
    c: Counter = Counter({"samples": 0})
    for t in trajectories:
        calls = t.tool_calls or []
        c["samples"] += 1
        c["turns"] += t.num_turns
        c["calls"] += len(calls)
        c["samples_with_calls"] += bool(calls)
        c["call_seconds"] += sum(call.seconds for call in calls)
        c["tool_tokens"] += sum(call.output_tokens for call in calls)
        c["response_tokens"] += len(t.response_token_ids)
        c["truncated_outputs"] += sum(call.output_truncated for call in calls)
        c["max_turns"] += t.finish_reason == "max_turns"
        c["malformed_calls"] += t.malformed_call
        for call in calls:
            if call.error:
                c[f"calls_error_{call.error}"] += 1
    return c


def tool_metrics(counts: Mapping[str, float]) -> dict[str, float]:
    """`tools/*` from `tool_counts` (one step's, or summed over a run): turns_per_sample, calls_per_sample,
    call_rate (share of samples with a call), errors_<kind> (calls), seconds_mean (per call), token_share (tool
    tokens / response tokens), truncated_outputs, malformed_calls, max_turns_share."""
    c = Counter(counts)
    n, calls = c["samples"], c["calls"]
    kinds = sorted(set(TOOL_ERRORS) | {k[len("calls_error_"):] for k in c if k.startswith("calls_error_")})
    return {
        "tools/turns_per_sample": c["turns"] / n if n else 0.0,
        "tools/calls_per_sample": calls / n if n else 0.0,
        "tools/call_rate": c["samples_with_calls"] / n if n else 0.0,
        **{f"tools/errors_{kind}": float(c[f"calls_error_{kind}"]) for kind in kinds},
        "tools/seconds_mean": c["call_seconds"] / calls if calls else 0.0,
        "tools/token_share": c["tool_tokens"] / c["response_tokens"] if c["response_tokens"] else 0.0,
        "tools/truncated_outputs": float(c["truncated_outputs"]),
        "tools/malformed_calls": float(c["malformed_calls"]),
        "tools/max_turns_share": c["max_turns"] / n if n else 0.0,
    }
