"""The simulator's tool model (multi-turn samples): how many tool calls a sample makes, where they fall in its
response, how long each tool runs and how many output tokens it appends. `SimulatorConfig.tools` holds a
`ToolScenario`; simulator/simulation.py plays each sample's `SamplePlan` on its engine: at a tool call the sample
gives up its engine slot while the tool runs, then comes back as a new request on its prefix (as
actors/decode_loop.py continues it). Tool tokens count in the response length but are never decoded.
"""

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from protocols.trajectory import ToolCall


class ToolScenario(BaseModel):
    """Tool calls of a tool-integrated-reasoning workload (the simulated side of the `tools:` config section)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    calls_per_sample: float = Field(4.0, ge=0, le=64)
    """Mean tool calls a sample would make if its turns and budget allowed (before max_turns and the budget)."""

    calls_distribution: Literal["fixed", "poisson"] = "poisson"
    """`fixed`: floor(mean) calls, one more with probability frac(mean); `poisson`: Poisson with that mean."""

    max_turns: int = Field(8, ge=1, le=256)
    """tools.max_turns: model turns per sample. A sample that would call more often ends at its last turn,
    marked truncated (finish reason `max_turns`)."""

    seconds_per_call: float = Field(0.4, ge=0)
    """Mean seconds a tool call runs (0: the tool answers at once, the no-latency reference). `decode_step_seconds`
    converts a multiple of a full engine's decode step into seconds."""

    seconds_distribution: Literal["fixed", "exponential", "lognormal"] = "exponential"
    """How a call's seconds spread around the mean; `lognormal` uses `seconds_sigma` and keeps the mean."""

    seconds_sigma: float = Field(1.0, ge=0, le=4)
    """Log-space spread of `lognormal` tool seconds."""

    output_tokens: int = Field(64, ge=0)
    """Tokens a call appends as context (its rendered output template); cut where the response budget ends."""

    pool_size: int | None = Field(None, ge=1)
    """tools.pool_size: calls a worker runs at once; more wait for a free one. None: no limit."""

    continue_first: bool = False
    """A sample back from its tool goes ahead of the engine's waiting requests (vLLM's `priority` scheduling
    policy with continuations at a higher priority). False: behind them, as any new request under vLLM's default
    first-come-first-served policy, so with a deep queue (prompts_in_flight * G > max_num_seqs) it waits for the
    queue to drain, its group ages, and more groups go stale."""

    def lengths_only(self) -> "ToolScenario":
        """The fields that shape a response's tokens (calls and output tokens), others at their defaults and no
        tool seconds: plans from it have the same turns and draw no seconds."""
        return ToolScenario(calls_per_sample=self.calls_per_sample, calls_distribution=self.calls_distribution,
                            max_turns=self.max_turns, output_tokens=self.output_tokens, seconds_per_call=0.0)


@dataclass(frozen=True)
class SamplePlan:
    """One multi-turn sample: model turns, each but possibly the last followed by a tool call."""

    turns: list[int]
    """Tokens the engine samples in each turn (at least one each)."""
    tool_seconds: list[float]
    """Seconds each call runs; one per call, after turns[i]. As many as turns when the budget ends at a tool
    output, one fewer otherwise."""
    tool_tokens: list[int]
    """Output tokens each call appends."""
    finish_reason: Literal["stop", "length", "max_turns"]

    @property
    def generated(self) -> int:
        return sum(self.turns)

    @property
    def response(self) -> int:
        """Response length: sampled tokens plus tool tokens."""
        return sum(self.turns) + sum(self.tool_tokens)


def decode_step_seconds(cfg) -> float:
    """Seconds of one decode step of a full engine (a + b * max_num_seqs) for a `SimulatorConfig`."""
    return cfg.decode_fixed_seconds + cfg.decode_seconds_per_seq * cfg.max_num_seqs


def _calls(rng: random.Random, tools: ToolScenario) -> int:
    mean = tools.calls_per_sample
    if tools.calls_distribution == "fixed":
        whole = int(mean)
        return whole + int(mean > whole and rng.random() < mean - whole)
    # Poisson by multiplying uniforms until the product drops below exp(-mean) (Knuth; mean is at most 64)
    limit, product, k = math.exp(-mean), rng.random(), 0
    while product > limit:
        product *= rng.random()
        k += 1
    return k


def _seconds(rng: random.Random, tools: ToolScenario) -> float:
    mean = tools.seconds_per_call
    if mean == 0 or tools.seconds_distribution == "fixed":
        return mean
    if tools.seconds_distribution == "exponential":
        return rng.expovariate(1.0 / mean)
    sigma = tools.seconds_sigma
    return mean * math.exp(rng.gauss(-sigma * sigma / 2, sigma))  # E[exp(N(-s^2/2, s^2))] = 1


def plan_sample(rng: random.Random, tools: ToolScenario, generated: int, max_response_tokens: int) -> SamplePlan:
    """Split a response of `generated` sampled tokens (the single-turn length model's draw) into turns at
    uniform cut points, one tool call between turns; tool tokens share the response budget, so a long response
    is cut where `max_response_tokens` ends. The seconds are drawn last, so plans that differ only in tool
    seconds have the same turns."""
    finish = "length" if generated >= max_response_tokens else "stop"
    calls = _calls(rng, tools)
    if calls > tools.max_turns - 1:
        calls, finish = tools.max_turns - 1, "max_turns"
    calls = min(calls, generated - 1)  # every turn samples at least one token (its call, or its answer)
    cuts = [0, *sorted(rng.sample(range(1, generated), calls)), generated]
    turns, tool_tokens, left = [], [], max_response_tokens
    for i in range(calls + 1):
        turn = cuts[i + 1] - cuts[i]
        turns.append(min(turn, left))
        left -= turns[-1]
        if turn > turns[-1] or (left == 0 and i < calls):
            finish = "length"  # the budget ended inside this turn, or at its tool call
            break
        if i < calls:
            tool_tokens.append(min(tools.output_tokens, left))
            left -= tool_tokens[-1]
            if left == 0:
                finish = "length"
                break
    return SamplePlan(turns, [_seconds(rng, tools) for _ in tool_tokens], tool_tokens, finish)


def mean_lengths(tools: ToolScenario, length_of, seed: int, max_response_tokens: int,
                 samples: int = 100_000) -> tuple[float, float]:
    """(mean sampled tokens, mean response tokens) per sample over `samples` plans; `length_of(rng)` draws a
    single-turn response length."""
    lengths_rng, tools_rng = random.Random(f"{seed}/capacity"), random.Random(f"{seed}/capacity/tools")
    generated = response = 0
    for _ in range(samples):
        plan = plan_sample(tools_rng, tools, length_of(lengths_rng), max_response_tokens)
        generated += plan.generated
        response += plan.response
    return generated / samples, response / samples


@dataclass
class EngineTools:
    """One simulated engine's samples in tool calls."""

    in_call: int = 0
    """Samples between a tool call and its return (running or waiting for the pool); they hold no slot."""
    running: int = 0
    """Calls running in the worker's tool pool."""
    queue: deque = field(default_factory=deque)
    """Samples whose call waits for a free place in the pool (tools.pool_size)."""
    continuations_waiting: int = 0
    """With continue_first: continuations at the head of the engine's waiting requests."""


class ToolTurns:
    """The agent loop of the simulated engines (actors/decode_loop.py's `on_request_end` seam), mixed into
    `Simulation`, whose `cfg`, `now`, `_push`, `_poke` and `_finish` it uses. A multi-turn sequence carries its
    `plan`, `turn`, `length` (this turn's sampled tokens), `versions` and `calls`; its engine, its `EngineTools`."""

    def _plan_group(self, group) -> None:
        """Split each sample's drawn length into turns, with its own generator per sample, so single-turn draws
        stay as they were; `length` becomes the first turn's sampled tokens."""
        for seq in group.sequences:
            rng = random.Random(f"{self.cfg.seed}/{group.group_id}/{seq.index}/tools")
            seq.plan = plan_sample(rng, self.cfg.tools, seq.length, self.cfg.max_response_tokens)
            seq.turn, seq.length, seq.response = 0, seq.plan.turns[0], seq.plan.response
            seq.versions, seq.calls = [], []

    def _turn_end(self, e, seq, versions: list[int]) -> None:
        """A turn's request ended with its tokens stamped `versions`: at a tool call the sample gives up its
        engine slot while the tool runs (the engine goes on decoding the others)."""
        seq.versions += versions
        if seq.turn == len(seq.plan.tool_seconds):
            self._finish(e, seq)
            return
        e.tools.in_call += 1
        e.tools.queue.append(seq)
        self._start_tools(e)

    def _start_tools(self, e) -> None:
        limit = self.cfg.tools.pool_size or math.inf
        while e.tools.queue and e.tools.running < limit:
            seq = e.tools.queue.popleft()
            e.tools.running += 1
            self._push(self.now + seq.plan.tool_seconds[seq.turn], "tool", e, seq)

    def _tool_done(self, e, seq, now: float) -> None:
        """The tool returned: its output becomes context and the sample continues as a new request, behind the
        engine's waiting requests (vLLM's FCFS); a response whose budget ended at the output is finished."""
        if e.exited:  # its group was aborted at stop
            return
        e.tools.running -= 1
        e.tools.in_call -= 1
        self._start_tools(e)
        plan, seconds = seq.plan, seq.plan.tool_seconds[seq.turn]
        self.tool_calls += 1
        self.tool_seconds += seconds
        stored = -(-plan.tool_tokens[seq.turn] // self.cfg.token_chunk)  # token_chunk tokens per stored entry
        seq.calls.append(ToolCall(name="sim", arguments="", output="", seconds=seconds,
                                  output_start=len(seq.versions), output_tokens=stored))
        seq.versions += [-1] * stored  # context: no version, and no behavior log-prob (see _finish)
        seq.turn += 1
        if seq.turn == len(plan.turns):
            self._finish(e, seq)
        else:
            seq.length = plan.turns[seq.turn]
            if self.cfg.tools.continue_first:  # after the continuations already waiting, before new requests
                e.waiting.insert(e.tools.continuations_waiting, seq)
                e.tools.continuations_waiting += 1
            else:
                e.waiting.append(seq)
        self._poke(e, now)  # the worker admits it, or hands over its scored group, after its current step
