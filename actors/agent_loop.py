"""The agent loop of a tool-using rollout: the decode loop's request-end hook (actors/decode_loop.py) when tools are
configured (protocols/tools.py).

A model turn that ended at a call's closing tag (the engine's stop string) is parsed (rewards/tool_calls.py); the
call runs in a thread pool beside the engine (rewards/tools.py ToolBox), and the sample waits off the engine
(`PENDING`), so the engine's slot serves other samples. Once the tool is done, its rendered output is appended as
a tool segment (tokenized once, no loss, no version) and the sample continues on its exact token prefix, with what
is left of its one response-token budget. Bad input is counted in `counts` and the sample goes on or ends; the
run never stops for it.

With `tools.call_format: hermes` the loop is a client of the session endpoint's code (gateway/): a turn ends at
the model's end of turn, its calls are read by gateway/hermes.py (all of them, run one after the other), and their
outputs go back as `tool` messages, rendered by the chat template after the turn's end (gateway/chat_render.py's
delta, the same tokens a session's next prompt gets).

With tools.environment each sample gets its own environment instance (rewards/environment.py Episode), reset when
the sample enters the engine (`start_sample`); text that `reset` returns is appended to the prompt's user message
and the sample's prompt encoded again (as TRL's environment_factory does); its calls go to the instance's methods,
and its reward attribute, read when the sample ends, goes on the sample (`environment_reward`) for the reward
worker.
"""

import json
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from actors.decode_loop import FINISHED, PENDING, Finished, Pending, RequestEnd, SampleInFlight
from gateway.chat_render import ChatRenderer
from gateway.hermes import parse_hermes
from protocols.reward import RewardConfig
from protocols.tools import ToolsConfig
from rewards.environment import Episode, load_environment
from rewards.tool_calls import MalformedCall, ParsedCall, argument_text, cut_output, parse_call, render_output
from rewards.tools import ToolBox, ToolResult

TIMEOUT_GRACE_S = 5.0
"""The ToolBox answers a call past tools.timeout_s itself (`timeout`); past timeout_s + this (a tool stuck where
the ToolBox cannot stop it, e.g. the sandbox's start) the loop gives up waiting and answers `timeout` itself."""

COUNTER_NAMES = ("calls", "malformed_calls", "max_turns", "truncated_outputs", "budget_cut_outputs",
                 "errors_unknown_tool", "errors_exception", "errors_timeout", "environment_episodes",
                 "environment_start_errors", "environment_bad_rewards", "environment_observations_shown",
                 "environment_observations_unshown")
"""`counts` keys, all present from the start: tool calls run; model turns that ended at `call_end` but could not
be read (each ends its sample as a plain response); samples stopped at tools.max_turns; outputs cut at
tools.max_output_tokens; tool segments cut because the response-token budget ran out; failed calls by kind;
environment episodes started, those whose constructor or reset raised, those whose reward was missing or not a
number (scored 0); those whose reset returned text shown in the sample's prompt, and those whose text was not
shown (the prompt with it would pass data.max_prompt_tokens, or the loop has no prompt encoder)."""


class _Call:
    """A tool call in the pool, and the sample waiting on it."""

    def __init__(self, sample: SampleInFlight, calls: list[ParsedCall]) -> None:
        self.sample = sample
        self.calls = calls
        """The turn's calls, run in order (one in the tagged format)."""
        self.started: float | None = None
        """When a pool thread began it (None while it waits for a thread): the timeout counts from here."""


class AgentLoop:
    """The `on_request_end` hook of a `DecodeLoop` (an `AsyncRequestEnd`): returns `FINISHED`, a `Finished` with a
    reason, or `PENDING` while the sample's tool runs; `ready()` hands waiting samples back with their decision."""

    def __init__(self, tools: ToolsConfig, reward: RewardConfig, tokenizer: Any,
                 toolbox: ToolBox | None = None,
                 encode_prompt: Callable[[str], list[int] | None] | None = None) -> None:
        self.cfg = tools
        self.tokenizer = tokenizer
        self.encode_prompt = encode_prompt
        """A prompt's user text -> its token ids as the data loader encodes them (template, system prompt, tools),
        None past data.max_prompt_tokens: how an environment's reset observation joins the prompt."""
        self.toolbox = toolbox if toolbox is not None else ToolBox(tools, reward)
        self.environment = load_environment(tools) if tools.environment else None
        self.episodes: dict[tuple[str, int], Episode] = {}
        """The environment instance of each sample in flight (tools.environment), by (group id, index)."""
        self.pool = ThreadPoolExecutor(max_workers=tools.pool_size, thread_name_prefix="tool")
        self.running: dict[Future, _Call] = {}
        self.counts: Counter = Counter({name: 0 for name in COUNTER_NAMES})
        self.tool_seconds = 0.0
        """Wall seconds the calls ran, summed (time waiting for a pool thread excluded)."""
        self.renderer = ChatRenderer(tokenizer) if tools.call_format == "hermes" else None
        if self.renderer is not None and self.renderer.delta_ids([{"role": "tool", "content": "1"}], None, {}) is None:
            raise ValueError(
                "tools.call_format=hermes renders tool outputs with the model's chat template, and this template "
                "does not render a `tool` message after an assistant turn's end as a prefix-stable delta; use a "
                "template with tool support (Qwen2.5's) or tools.call_format=tagged")

    # --- a model turn ended ------------------------------------------------------------------------------------
    def __call__(self, sample: SampleInFlight, output: Any) -> RequestEnd | Pending:
        if self.environment is not None and (sample.group_id, sample.index) not in self.episodes:
            # a loop that did not call start_sample: the prompt is already in the engine, so reset's text is unshown
            self.counts["environment_observations_unshown"] += bool(self._start_episode(sample).observation)
        decision = self._turn_end(sample, output)
        return decision if isinstance(decision, Pending) else self._end(sample, decision)

    def _turn_end(self, sample: SampleInFlight, output: Any) -> RequestEnd | Pending:
        parsed = self._parse(output.outputs[0])
        if parsed is None:
            return FINISHED  # a plain answer (or the budget ran out mid-call)
        if isinstance(parsed, MalformedCall):
            self.counts["malformed_calls"] += 1
            return Finished(malformed_call=True)
        if sample.requests_ended >= self.cfg.max_turns:
            self.counts["max_turns"] += 1
            return Finished(reason="max_turns")
        if sample.tokens_left <= 0:
            return Finished(reason="length")  # no room for the tool's output, let alone an answer
        call = _Call(sample, parsed)
        self.running[self.pool.submit(self._run, call)] = call
        return PENDING

    def _parse(self, completion: Any) -> list[ParsedCall] | MalformedCall | None:
        if self.renderer is None:
            parsed = parse_call(completion.text, self.cfg)
            return [parsed] if isinstance(parsed, ParsedCall) else parsed
        if completion.finish_reason == "length":
            return None  # cut mid-turn: a call it may hold was never closed by the model
        reply = parse_hermes(completion.text)
        if reply.error:
            return MalformedCall(reply.error)
        if not reply.tool_calls:
            return None
        if self.environment is not None:  # the environment's methods take the JSON object as keyword arguments
            return [ParsedCall(c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls]
        return [ParsedCall(c["function"]["name"], argument_text(json.loads(c["function"]["arguments"])))
                for c in reply.tool_calls]

    def _run(self, call: _Call) -> list[ToolResult]:
        call.started = time.monotonic()
        results = []
        for parsed in call.calls:
            started = time.monotonic()
            left = self.cfg.timeout_s - (started - call.started)
            if left <= 0:
                results.append(ToolResult(f"TimeoutError: the turn's calls ran past tools.timeout_s="
                                          f"{self.cfg.timeout_s:g} s", "timeout", 0.0))
                continue
            episode = self.episodes.get((call.sample.group_id, call.sample.index))
            results.append(episode.call(parsed.name, parsed.arguments) if episode is not None
                           else self.toolbox.run(parsed.name, parsed.arguments))
        return results

    # --- environment episodes ----------------------------------------------------------------------------------
    def start_sample(self, sample: SampleInFlight) -> None:
        """The decode loop's call as a sample enters the engine: its environment episode starts (reset with the
        prompt's row), and text that reset returned is appended to the prompt's user message (TRL's
        environment_factory: `content + observation`, no separator), the sample's prompt encoded again."""
        if self.environment is None or (sample.group_id, sample.index) in self.episodes:
            return
        episode = self._start_episode(sample)
        if not episode.observation:
            return
        text = sample.prompt.prompt_text + episode.observation
        ids = self.encode_prompt(text) if self.encode_prompt is not None else None
        if ids is None:
            self.counts["environment_observations_unshown"] += 1
            return
        sample.prompt = sample.prompt.model_copy(update={"prompt_token_ids": ids, "prompt_text": text})
        self.counts["environment_observations_shown"] += 1

    def _start_episode(self, sample: SampleInFlight) -> Episode:
        episode = Episode(self.environment, sample.prompt, self.cfg)
        self.episodes[(sample.group_id, sample.index)] = episode
        self.counts["environment_episodes"] += 1
        self.counts["environment_start_errors"] += bool(episode.error)
        return episode

    def _end(self, sample: SampleInFlight, decision: RequestEnd) -> RequestEnd:
        """A sample that ends reads its episode's reward (0 and counted when it is missing or not a number)."""
        if self.environment is None or not isinstance(decision, Finished):
            return decision
        episode = self.episodes.pop((sample.group_id, sample.index), None)
        if episode is None:
            return decision
        reward = episode.reward()
        self.counts["environment_bad_rewards"] += reward is None
        sample.environment_reward = 0.0 if reward is None else reward
        return decision

    # --- tools that are done -----------------------------------------------------------------------------------
    def ready(self) -> list[tuple[SampleInFlight, RequestEnd]]:
        """Samples whose tool finished (or ran past its time), each with its continuation or its end."""
        out = []
        now = time.monotonic()
        for future, call in list(self.running.items()):
            if future.done():
                results = future.result()
            elif call.started is not None and now - call.started > self.cfg.timeout_s + TIMEOUT_GRACE_S:
                # the thread is left to finish; its result is dropped
                results = [ToolResult(f"TimeoutError: the tool ran past tools.timeout_s={self.cfg.timeout_s:g} s",
                                      "timeout", now - call.started)] * len(call.calls)
            else:
                continue
            del self.running[future]
            decision = (self._append(call, results[0]) if self.renderer is None
                        else self._append_messages(call, results))
            out.append((call.sample, self._end(call.sample, decision)))
        return out

    def _count(self, result: ToolResult) -> None:
        self.counts["calls"] += 1
        if result.error:
            self.counts[f"errors_{result.error}"] += 1
        self.tool_seconds += result.seconds

    def _append_messages(self, call: _Call, results: list[ToolResult]) -> RequestEnd:
        """Hermes: the outputs as `tool` messages, rendered by the chat template after the turn's end (one
        segment for the turn; the first call's record holds it, the others hold none)."""
        sample = call.sample
        outputs = []
        for result in results:
            self._count(result)
            output, truncated = cut_output(result.output, self.cfg.max_output_tokens, self.tokenizer)
            self.counts["truncated_outputs"] += truncated
            outputs.append((output, truncated))
        end = self.renderer.turn_end_ids
        closed = sample.response_token_ids[-len(end):] == end
        token_ids = [*([] if closed else end), *self.renderer.delta_ids(
            [{"role": "tool", "content": output} for output, _ in outputs], None, {})]
        if len(token_ids) > sample.tokens_left:
            self.counts["budget_cut_outputs"] += 1
            token_ids = token_ids[:sample.tokens_left]
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        for i, (parsed, result, (output, truncated)) in enumerate(zip(call.calls, results, outputs)):
            sample.append_tool_output(token_ids if i == 0 else [], text if i == 0 else "", name=parsed.name,
                                      arguments=parsed.arguments, output=output, error=result.error,
                                      seconds=result.seconds, output_truncated=truncated)
        return sample.continue_here() if sample.tokens_left > 0 else Finished(reason="length")

    def _append(self, call: _Call, result: ToolResult) -> RequestEnd:
        """Append the tool's rendered output to the sample; go on if budget is left for the model to answer."""
        sample = call.sample
        self._count(result)
        rendered = render_output(result.output, self.cfg, self.tokenizer)
        self.counts["truncated_outputs"] += rendered.truncated
        token_ids, text = rendered.token_ids, rendered.text
        if len(token_ids) > sample.tokens_left:
            # the response budget (rollout.max_response_tokens) counts tool tokens too: keep what fits
            self.counts["budget_cut_outputs"] += 1
            token_ids = token_ids[:sample.tokens_left]
            text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        sample.append_tool_output(token_ids, text, name=call.calls[0].name, arguments=call.calls[0].arguments,
                                  output=rendered.output, error=result.error, seconds=result.seconds,
                                  output_truncated=rendered.truncated)
        return sample.continue_here() if sample.tokens_left > 0 else Finished(reason="length")

    # --- the worker's side -------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self.running)

    def cancel(self) -> None:
        """Forget every waiting sample (the decode loop aborted): calls not started are cancelled; running ones
        finish in their threads and are dropped."""
        for future in self.running:
            future.cancel()
        self.running.clear()
        self.episodes.clear()

    def report(self) -> dict[str, float]:
        """The counters since this loop started, for the worker's report (`tools` there)."""
        return {**self.counts, "seconds": self.tool_seconds}

    def close(self) -> None:
        self.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)
