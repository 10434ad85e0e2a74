"""The rollout worker's decode loop, without vLLM: requests in, sampled groups out, one engine step at a time.

`RolloutWorker` (actors/rollout_worker.py) owns the engine and calls `step` between its safe points; this class
turns the engine's outputs into `Trajectory` records, stamping every token with the policy version of the
weights that sampled it. When a request ends, `on_request_end` decides whether its sample is finished or goes on
as a new request on its exact token prefix (prompt + every segment so far): the seam a multi-turn agent loop
plugs into (actors/agent_loop.py: a sample that stopped at a tool call continues after the tool's output). The
hook may also keep a sample (`PENDING`) while its tool runs: the sample's request is over, so its engine slot
serves the other samples, and the hook hands it back from `ready()` once the tool is done. The default finishes.

Besides groups, the loop serves single calls of the session endpoint (gateway/): `start_call` adds one request
on the prompt the endpoint built, with its own sampling parameters; it ends with its request (the client runs its
own tools) and waits in `finished_calls` (not returned by `step`) as a one-sample group, versions per token.
"""

import heapq
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from protocols.trajectory import FinishReason, Prompt, ToolCall, Trajectory, TrajectoryGroup


@dataclass(frozen=True)
class Continue:
    """Go on as a new request that starts from `prefix_ids` and may sample at most `max_tokens` more."""

    prefix_ids: list[int]
    """The sample's exact token prefix: prompt + every segment so far (`SampleInFlight.prefix_ids`)."""
    max_tokens: int
    """At most what the sample's budget has left (`SampleInFlight.tokens_left`)."""


@dataclass(frozen=True)
class Finished:
    """The sample is complete: it becomes a `Trajectory`."""

    reason: FinishReason | None = None
    """Overrides the engine's finish reason (e.g. `max_turns`); None keeps the engine's (`stop` or `length`)."""
    malformed_call: bool = False
    """The last turn tried a tool call that did not parse (Trajectory.malformed_call)."""


@dataclass(frozen=True)
class Pending:
    """The hook keeps the sample (its tool is running); the loop asks the hook's `ready()` for it each step."""


FINISHED = Finished()
PENDING = Pending()
RequestEnd = Continue | Finished


@dataclass
class SampleInFlight:
    """One sample of a group across its requests: the tokens sampled so far, their behavior log-probs and the
    policy version of each."""

    group_id: str
    index: int
    prompt: Prompt
    max_response_tokens: int
    response_token_ids: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    """One per token streamed so far; runs ahead of `response_token_ids` while a request is going."""
    response_text: str = ""
    requests_ended: int = 0
    """Requests that ended so far."""
    tool_calls: list[ToolCall] = field(default_factory=list)
    """Tool calls so far, each with where its output segment lies in `response_token_ids`."""
    environment_reward: float | None = None
    """The reward its environment episode gave when it ended (tools.environment); None without one."""

    @property
    def prefix_ids(self) -> list[int]:
        return [*self.prompt.prompt_token_ids, *self.response_token_ids]

    @property
    def tokens_left(self) -> int:
        return self.max_response_tokens - len(self.response_token_ids)

    def append_tool_output(self, token_ids: list[int], text: str, *, name: str, arguments: str, output: str,
                           error: str = "", seconds: float = 0.0, output_truncated: bool = False) -> ToolCall:
        """Append a tool segment: `token_ids` (the rendered output template, tokenized once) become context with
        no behavior log-prob (0.0) and no version (-1), so they never train. Returns the recorded call."""
        call = ToolCall(name=name, arguments=arguments, output=output, error=error, seconds=seconds,
                        output_truncated=output_truncated, output_start=len(self.response_token_ids),
                        output_tokens=len(token_ids), text_end=len(self.response_text) + len(text))
        self.response_token_ids.extend(token_ids)
        self.behavior_logprobs.extend([0.0] * len(token_ids))
        self.token_versions.extend([-1] * len(token_ids))
        self.response_text += text
        self.tool_calls.append(call)
        return call

    def continue_here(self) -> Continue:
        """A continuation on this sample's prefix with the rest of its budget."""
        return Continue(self.prefix_ids, self.tokens_left)


def finish_every_request(sample: SampleInFlight, output: Any) -> RequestEnd:
    """The single-turn rule: a sample ends with its first request."""
    return FINISHED


class Engine(Protocol):
    """What the loop needs of vLLM's `LLMEngine`."""

    def add_request(self, request_id: str, prompt: dict, params: Any) -> None: ...
    def step(self) -> list: ...
    def has_unfinished_requests(self) -> bool: ...
    def abort_request(self, request_ids: list[str]) -> None: ...


SamplingParamsFor = Callable[[SampleInFlight, int], Any]
"""(sample, max_tokens) -> the engine's sampling parameters for the sample's next request."""


class AsyncRequestEnd(Protocol):
    """A hook that may keep samples (`PENDING`), such as the agent loop while a tool runs."""

    def __call__(self, sample: SampleInFlight, output: Any) -> RequestEnd | Pending: ...

    def ready(self) -> list[tuple[SampleInFlight, RequestEnd]]:
        """Samples it kept that may go on now, each with its decision; never blocks."""

    def cancel(self) -> None:
        """Forget every sample it keeps (the loop aborted their groups)."""


IDLE_WAIT_S = 0.002
"""A step that finds the engine empty and no kept sample ready sleeps this long, so the worker's loop does not
spin on a core while only tools run."""


class _GroupInFlight:
    def __init__(self, group_id: str, prompt: Prompt, size: int, max_response_tokens: int) -> None:
        self.group_id = group_id
        self.samples = [SampleInFlight(group_id, i, prompt, max_response_tokens) for i in range(size)]
        self.trajectories: list[Trajectory | None] = [None] * size

    @property
    def done(self) -> bool:
        return all(t is not None for t in self.trajectories)


class DecodeLoop:
    """The groups a worker's engine is generating. `on_request_end(sample, output)` returns `Continue`,
    `Finished` or (an `AsyncRequestEnd` hook only) `PENDING`; its `output` is the engine's `RequestOutput` of the
    request that ended. With `max_num_seqs` (rollout.length_aware_dispatch) the loop holds started groups and
    hands the engine the one with the longest expected length, whole, whenever the engine has fewer requests than
    max_num_seqs, so the engine's own queue never holds more than one group."""

    def __init__(self, engine: Engine, sampling_params: SamplingParamsFor, samples_per_prompt: int,
                 max_response_tokens: int, worker_id: int,
                 on_request_end: Callable[[SampleInFlight, Any], RequestEnd] | AsyncRequestEnd = finish_every_request,
                 max_num_seqs: int | None = None) -> None:
        self.engine = engine
        self.sampling_params = sampling_params
        self.samples_per_prompt = samples_per_prompt
        self.max_response_tokens = max_response_tokens
        self.worker_id = worker_id
        self.on_request_end = on_request_end
        self.active: dict[str, _GroupInFlight] = {}
        self.requests: dict[str, tuple[SampleInFlight, int]] = {}
        """request id -> (its sample, tokens of this request already streamed)."""
        self.waiting: dict[tuple[str, int], SampleInFlight] = {}
        """(group id, sample index) -> a sample the hook keeps (`PENDING`): it holds no engine slot."""
        self.decoded = False
        """Whether the last `step` ran the engine (False: it only collected kept samples, or waited for them)."""
        self.max_num_seqs = max_num_seqs
        self.held: list[tuple[float, int, _GroupInFlight]] = []
        """Length-aware dispatch: heap of (minus expected length, arrival, group) not yet in the engine."""
        self.arrivals = 0
        self.calls: dict[str, Any] = {}
        """group id -> sampling parameters of each single call in flight (`start_call`)."""
        self.finished_calls: list[TrajectoryGroup] = []
        """Single calls that ended, for their caller to take (gateway/engine_bridge.py)."""
        self.call_logprobs: dict[str, list[dict[int, tuple[float, int]]]] = {}
        """call id -> per sampled token, id -> (log-prob, rank) of the sampled token and the alternatives, for an
        ended call whose parameters asked for alternatives (`logprobs` > 0); its caller takes them."""
        self.on_call_tokens: Callable[[str, list[int]], None] | None = None
        """Called after each engine step with (call id, every id the call sampled so far: the engine's own list,
        to copy before keeping) for each single call that has not ended: what a streamed reply sends as it is
        sampled (gateway/engine_bridge.py)."""

    @property
    def groups_in_flight(self) -> int:
        """Groups the controller granted that are in flight (single calls of the endpoint not counted)."""
        return len(self.active) - len(self.calls)

    def start_call(self, call_id: str, prompt_ids: list[int], params: Any) -> None:
        """A single call of the session endpoint: one request on `prompt_ids` with `params` (its max_tokens
        included), finished when the request ends; it then waits in `finished_calls` as a one-sample group with id
        `call_id`."""
        if call_id in self.active:
            raise ValueError(f"call {call_id!r} is already in flight; call ids must be unique")
        group = _GroupInFlight(call_id, Prompt(prompt_id=call_id, prompt_token_ids=list(prompt_ids)), 1,
                               params.max_tokens)
        self.active[call_id] = group
        self.calls[call_id] = params
        self._add_request(group.samples[0], group.samples[0].prefix_ids, params.max_tokens)

    def start_group(self, group_id: str, prompt: Prompt, expected_length: float = 0.0) -> None:
        group = _GroupInFlight(group_id, prompt, self.samples_per_prompt, self.max_response_tokens)
        self.active[group_id] = group
        if self.max_num_seqs is None:
            self._add_group(group)
        else:
            self.arrivals += 1  # ties keep arrival order
            heapq.heappush(self.held, (-expected_length, self.arrivals, group))

    def _add_group(self, group: _GroupInFlight) -> None:
        start_sample = getattr(self.on_request_end, "start_sample", None)
        for sample in group.samples:
            if start_sample is not None:  # the agent loop may give the sample a prompt of its own (an observation)
                start_sample(sample)
            self._add_request(sample, sample.prefix_ids, self.max_response_tokens)

    def _dispatch(self) -> None:
        """Length-aware dispatch: the longest-expected held groups while the engine has free slots."""
        while self.held and len(self.requests) < self.max_num_seqs:
            self._add_group(heapq.heappop(self.held)[2])

    def _add_request(self, sample: SampleInFlight, prefix_ids: list[int], max_tokens: int) -> None:
        # the first request keeps the id (and, in the worker, the seed) of a single-turn sample
        suffix = f"/{sample.requests_ended}" if sample.requests_ended else ""
        request_id = f"{sample.group_id}/{sample.index}{suffix}"
        self.requests[request_id] = (sample, 0)
        params = self.calls.get(sample.group_id)
        self.engine.add_request(request_id, {"prompt_token_ids": prefix_ids},
                                params if params is not None else self.sampling_params(sample, max_tokens))

    def has_unfinished(self) -> bool:
        """Requests in the engine, or samples the hook keeps (their tools still run)."""
        return self.engine.has_unfinished_requests() or bool(self.waiting) or bool(self.held)

    def step(self, version: int) -> list[TrajectoryGroup]:
        """Continue the kept samples the hook has ready, then one engine step; tokens it sampled carry `version`.
        Returns the groups it finished."""
        finished = []
        if self.held:
            self._dispatch()
        ready = self.on_request_end.ready() if self.waiting else []
        for sample, decision in ready:
            if self.waiting.get((sample.group_id, sample.index)) is not sample:
                continue  # its group was aborted meanwhile
            del self.waiting[(sample.group_id, sample.index)]
            # after a tool the last request had ended at the call's stop string
            finished.append(self._apply(sample, decision, "stop"))
        self.decoded = self.engine.has_unfinished_requests()
        if self.decoded:
            finished.extend(self._on_output(out, version) for out in self.engine.step())
        elif self.waiting and not ready:
            time.sleep(IDLE_WAIT_S)
        return [group for group in finished if group is not None]

    def _on_output(self, out: Any, version: int) -> TrajectoryGroup | None:
        sample, seen = self.requests[out.request_id]
        completion = out.outputs[0]
        sample.token_versions.extend([version] * (len(completion.token_ids) - seen))
        self.requests[out.request_id] = (sample, len(completion.token_ids))
        if not out.finished:
            if self.on_call_tokens is not None and sample.group_id in self.calls:
                self.on_call_tokens(sample.group_id, completion.token_ids)  # copied only for a streamed call
            return None
        del self.requests[out.request_id]
        sample.response_token_ids.extend(completion.token_ids)
        # vLLM may drop tokens streamed past a stop string in the step that completed it: versions follow the ids
        del sample.token_versions[len(sample.response_token_ids):]
        # by the sampled id: with alternatives asked for (an endpoint call's top_logprobs) each position holds several
        sample.behavior_logprobs.extend(d[t].logprob for d, t in zip(completion.logprobs, completion.token_ids))
        params = self.calls.get(sample.group_id)
        if params is not None and getattr(params, "logprobs", 0):
            self.call_logprobs[sample.group_id] = [{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                                                   for d in completion.logprobs]
        sample.response_text += completion.text
        sample.requests_ended += 1
        decision = FINISHED if sample.group_id in self.calls else self.on_request_end(sample, out)
        return self._apply(sample, decision, "length" if completion.finish_reason == "length" else "stop")

    def _apply(self, sample: SampleInFlight, decision: RequestEnd | Pending,
               engine_reason: FinishReason) -> TrajectoryGroup | None:
        if isinstance(decision, Pending):
            if not hasattr(self.on_request_end, "ready"):
                raise TypeError(
                    f"sample {sample.group_id}/{sample.index}: on_request_end returned PENDING but has no ready() "
                    "to hand the sample back; only an AsyncRequestEnd hook (e.g. actors/agent_loop.py) may keep one")
            self.waiting[(sample.group_id, sample.index)] = sample
            return None
        if isinstance(decision, Continue):
            self._check(sample, decision)
            self._add_request(sample, decision.prefix_ids, decision.max_tokens)
            return None
        group = self.active[sample.group_id]
        group.trajectories[sample.index] = Trajectory(
            group_id=sample.group_id, sample_index=sample.index, prompt=sample.prompt,
            response_token_ids=sample.response_token_ids, behavior_logprobs=sample.behavior_logprobs,
            token_versions=sample.token_versions, response_text=sample.response_text,
            finish_reason=decision.reason or engine_reason,
            worker_id=self.worker_id, tool_calls=sample.tool_calls or None, malformed_call=decision.malformed_call,
            environment_reward=sample.environment_reward,
        )
        if not group.done:
            return None
        del self.active[sample.group_id]
        done = TrajectoryGroup(group_id=sample.group_id, trajectories=group.trajectories)
        if self.calls.pop(sample.group_id, None) is not None:
            self.finished_calls.append(done)
            return None
        return done

    @staticmethod
    def _check(sample: SampleInFlight, decision: Continue) -> None:
        if decision.prefix_ids != sample.prefix_ids:
            # Tokens the engine did not sample (a tool's output) go in through append_tool_output, which masks them.
            raise ValueError(
                f"sample {sample.group_id}/{sample.index}: a continuation must start from the sample's exact prefix "
                f"(prompt + the {len(sample.response_token_ids)} tokens sampled so far), got "
                f"{len(decision.prefix_ids)} different tokens; build it with SampleInFlight.continue_here()")
        if not 0 < decision.max_tokens <= sample.tokens_left:
            raise ValueError(
                f"sample {sample.group_id}/{sample.index}: a continuation's max_tokens={decision.max_tokens} must be "
                f"between 1 and the {sample.tokens_left} tokens its budget (rollout.max_response_tokens="
                f"{sample.max_response_tokens}) has left; return Finished once it is spent")

    def abort(self) -> list[str]:
        """Abort every request and drop the samples the hook keeps (their tools' results are not waited for);
        returns the ids of the groups that were in flight (they are forgotten), single calls not included (their
        caller, which knows what it started, learns it from `calls` being cleared)."""
        if self.requests:
            self.engine.abort_request(list(self.requests))
            self.requests.clear()
        if self.waiting:
            self.on_request_end.cancel()
            self.waiting.clear()
        group_ids = [g for g in self.active if g not in self.calls]
        self.active.clear()
        self.calls.clear()
        self.held.clear()
        return group_ids
