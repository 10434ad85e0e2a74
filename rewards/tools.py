"""The tools a policy may call during a rollout: `python` (the code verifier's sandbox), `calculator`, and user
tools given as `module:function` (tools.custom).

The agent loop (actors/agent_loop.py) builds one `ToolBox` per rollout worker and calls `run` from its tool pool,
beside the engine; `run` never raises: an unknown name, a tool that raises or one that runs past tools.timeout_s
gives its error kind (protocols/trajectory.py ToolError) and an error text that becomes the tool's output.
"""

import ast
import importlib
import logging
import math
import operator
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocols.reward import RewardConfig
from protocols.tools import ToolsConfig
from protocols.trajectory import ToolError
from rewards import sandbox_cgroup
from rewards.code_sandbox import run_in_sandbox

log = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 1000
"""Characters of a failed program's stderr kept after its stdout: the traceback's end, which names the error."""
MAX_EXPRESSION_CHARS = 1000
"""The calculator refuses a longer expression, unread."""
MAX_EXPRESSION_DEPTH = 200
"""The calculator refuses an expression whose syntax tree is deeper than this (`-` 200 times, `1+1+...+1` with
more than 200 terms), before evaluating it: evaluation recurses once per level. Parentheses add no level; Python's
parser itself refuses more than 200 nested ones."""
MAX_RESULT_DIGITS = 1000
"""The calculator refuses a number (operand, intermediate or result) with more digits than this; a power is
refused before it is computed: `9**9**9` would take minutes and gigabytes."""
_RESULT_LIMIT = 10**MAX_RESULT_DIGITS
"""The smallest integer with more than MAX_RESULT_DIGITS digits."""
_FENCED = re.compile(r"```[^\n`]*\n(.*?)\n?```", re.DOTALL)


@dataclass(frozen=True)
class ToolResult:
    output: str
    """The tool's output text, or the error text when it failed (that text is still what the model reads)."""
    error: ToolError
    """Empty on success; else `unknown_tool`, `exception` (it raised, refused, or the program failed) or
    `timeout`."""
    seconds: float
    """Wall time of the call."""


class ToolBox:
    """The tools of one run, by name. User tools are imported once, here: a bad `module:function` fails the
    worker's start with a message naming tools.custom.NAME, not every call."""

    def __init__(self, tools: ToolsConfig, reward: RewardConfig):
        self.cfg = tools
        self.reward = reward
        self._tools: dict[str, Callable[[str], ToolResult]] = {}
        for name in tools.builtin:
            self._tools[name] = self._python if name == "python" else self._in_thread(calculate)
        for name, target in tools.custom.items():
            self._tools[name] = self._in_thread(_load(name, target))
        if "python" in self._tools:
            # Probe for a writable memory cgroup now, once: pool threads that raced to the first probe could
            # leave the sandbox with the per-process memory limit only.
            sandbox_cgroup.scope()

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def run(self, name: str, arguments: str) -> ToolResult:
        """Run tool `name` on the call's argument text. Never raises."""
        start = time.perf_counter()
        tool = self._tools.get(name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return ToolResult(f"unknown tool {name!r}; the tools are: {known}", "unknown_tool",
                              time.perf_counter() - start)
        try:
            result = tool(arguments)
        except BaseException as err:  # noqa: BLE001 - a tool's failure is the sample's tool output, never the worker's
            if isinstance(err, KeyboardInterrupt):
                raise
            result = ToolResult(f"{type(err).__name__}: {err}", "exception", 0.0)
        return ToolResult(result.output, result.error, time.perf_counter() - start)

    def _python(self, arguments: str) -> ToolResult:
        # Exactly the code verifier's sandbox and limits (reward.code), with the tool's wall limit. The sandbox's
        # parent-death signal follows the thread that starts it: a pool thread lives as long as the call.
        run = run_in_sandbox(_program(arguments), self.reward.code, timeout_s=self.cfg.timeout_s)
        if run.status == "ok":
            return ToolResult(run.stdout, "", run.seconds)
        if run.status == "timeout":
            text = f"TimeoutError: the program ran past tools.timeout_s={self.cfg.timeout_s:g} s and was stopped"
            return ToolResult(_join(run.stdout, text), "timeout", run.seconds)
        if run.status == "setup_failed":
            # Fail closed, as the verifier does: the program did not run.
            log.warning("python tool: the code sandbox could not start: %s", run.stderr.strip()[:500])
            return ToolResult("RuntimeError: the code sandbox could not start; the program did not run",
                              "exception", run.seconds)
        tail = run.stderr[-STDERR_TAIL_CHARS:].strip() or (
            "RuntimeError: the program ended with an error status (sys.exit, or killed at a CPU, memory or output "
            "limit of reward.code)")
        return ToolResult(_join(run.stdout, tail), "exception", run.seconds)

    def _in_thread(self, fn: Callable[[str], object]) -> Callable[[str], ToolResult]:
        """`fn` in a thread of its own, waited on for tools.timeout_s (`call_in_thread`): only trusted code belongs
        here (untrusted programs go through the `python` tool)."""
        name = getattr(fn, "__name__", "fn")
        return lambda arguments: call_in_thread(fn, (arguments,), {}, self.cfg.timeout_s, f"tool {name}")


def call_in_thread(fn: Callable, args: tuple, kwargs: dict, timeout_s: float, what: str) -> ToolResult:
    """`fn(*args, **kwargs)` in a thread of its own, waited on for `timeout_s`; its return value as text, or its
    exception by kind. A thread cannot be killed: past the limit the call is answered `timeout` and the thread is
    left to finish (logged)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - reported as the call's `exception`
            box["error"] = err

    thread = threading.Thread(target=target, name=what.replace(" ", "-"), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.warning("%s ran past tools.timeout_s=%g s; its thread is left running", what, timeout_s)
        return ToolResult(f"TimeoutError: the tool ran past tools.timeout_s={timeout_s:g} s", "timeout", 0.0)
    if "error" in box:
        err = box["error"]
        return ToolResult(f"{type(err).__name__}: {err}", "exception", 0.0)
    value = box.get("value")
    return ToolResult("" if value is None else str(value), "", 0.0)


def load_target(setting: str, target: str, shape: str) -> object:
    """The object a `module:name` setting names (`setting` is the setting's dotted name, `shape` what `name`
    should be, for the error); a bad name fails the worker's start."""
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"{setting}={target!r} could not be loaded ({type(err).__name__}: {err}); give `module:{shape}` with "
            "the module importable by the rollout workers (on PYTHONPATH)") from err


def _load(name: str, target: str) -> Callable[[str], object]:
    fn = load_target(f"tools.custom.{name}", target, "function")
    if not callable(fn):
        raise ValueError(f"tools.custom.{name}={target!r} is a {type(fn).__name__}, not a function")
    return fn


def _program(arguments: str) -> str:
    """The program in a call: the arguments, or the body of the one fenced block they are wrapped in."""
    match = _FENCED.fullmatch(arguments.strip())
    return match.group(1) if match else arguments


def _join(stdout: str, tail: str) -> str:
    return f"{stdout.rstrip()}\n{tail.strip()}" if stdout.strip() else tail.strip()


# ----- calculator ---------------------------------------------------------------------------------------------
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression: + - * / // % ** and parentheses over integers and decimals, as
    Python computes them, read from its syntax tree (never `eval`). Integers are exact; a float that is a whole
    number prints without `.0` (`6/3` is `2`). Raises ValueError for anything else (names, calls, `^`), for an
    expression over MAX_EXPRESSION_CHARS characters or MAX_EXPRESSION_DEPTH levels, for a number over
    MAX_RESULT_DIGITS digits (a power refused before it is computed) and for a value too large for a float;
    ZeroDivisionError for `/ 0`."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression of {len(text)} characters; the calculator takes at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    except (RecursionError, MemoryError):
        raise ValueError(f"expression nested too deeply to read; the calculator takes at most "
                         f"{MAX_EXPRESSION_DEPTH} levels") from None
    depth = _depth(tree.body)
    if depth > MAX_EXPRESSION_DEPTH:
        raise ValueError(f"expression nested {depth} levels deep; the calculator takes at most {MAX_EXPRESSION_DEPTH}")
    try:
        return _format(_eval(tree.body))
    except OverflowError:
        # a value past the float range (`10**400 / 3`, `10.0**400`): refused like the other limits
        raise ValueError(f"a value is too large for a float (over {sys.float_info.max:.3g})") from None


def _depth(root: ast.AST) -> int:
    """Levels of the syntax tree below and including `root` (operators count as a level), counted without
    recursion."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in ast.iter_child_nodes(node))
    return deepest


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("`^` is not a power here; write `**`")
    raise ValueError(f"unsupported expression {_short(ast.unparse(node))}: only numbers, + - * / // % ** and "
                     "parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    # |base| ** exponent has floor(exponent * log10|base|) + 1 digits: refuse before computing it when that is
    # over MAX_RESULT_DIGITS. Written as a division so a 1,000-digit exponent is never turned into a float.
    if abs(base) > 1 and exponent > 0 and exponent >= MAX_RESULT_DIGITS / math.log10(abs(base)):
        shown = f"({_short(base)})" if base < 0 else _short(base)
        raise ValueError(f"{shown} ** {_short(exponent)} has more than {MAX_RESULT_DIGITS} digits")


def _checked(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is a complex number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if isinstance(value, int) and abs(value) >= _RESULT_LIMIT:
        raise ValueError(f"a number has more than {MAX_RESULT_DIGITS} digits")
    return value


def _short(value: object, chars: int = 40) -> str:
    """`value` for a message: its text (repr of a string), cut to `chars` characters."""
    text = repr(value) if isinstance(value, str) else _format(value)
    return text if len(text) <= chars else text[: chars - 3] + "..."


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)
