"""The agent loop (actors/agent_loop.py) as the decode loop's hook, with a scripted engine and scripted tools: a
sample waiting on a tool leaves the engine, continues on its exact prefix with the tool's tokens as context, and
keeps to its budgets; bad input is counted and the run goes on."""

import threading
import time
from types import SimpleNamespace

import pytest

from actors import agent_loop as agent_loop_module
from actors.agent_loop import AgentLoop
from actors.decode_loop import FINISHED, DecodeLoop, Finished
from protocols.reward import RewardConfig
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt
from rewards.tools import ToolBox, ToolResult
from tests.test_decode_loop import ScriptedEngine

VOCAB = ["?", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "calc", "nope", ":", "*",
         *"0123456789", "a", "b", "calculator"]
"""Token ids of the scripted tokenizer: `?` 0 (any other character), `<tool_call>` 1, `</tool_call>` 2,
`<tool_response>` 3, `</tool_response>` 4, `calc` 5, `nope` 6, `:` 7, `*` 8, digits 9-18, `a` 19, `b` 20,
`calculator` 21."""
ID = {text: i for i, text in enumerate(VOCAB)}
CALL, END, RESP, RESP_END, CALC, COLON, TIMES = 1, 2, 3, 4, 5, 7, 8


def digits(text: str) -> list[int]:
    return [ID[c] for c in text]


class Tokenizer:
    """Longest match over VOCAB (a character in no piece is `?`); decoding joins the pieces."""

    def encode(self, text, add_special_tokens=True):
        ids, i = [], 0
        while i < len(text):
            piece = max((v for v in VOCAB if text.startswith(v, i)), key=len, default="?")
            ids.append(ID[piece])
            i += max(len(piece), 1)
        return ids

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(VOCAB[t] for t in token_ids)


class ScriptedTools:
    """A stand-in ToolBox: `calc` returns the product of `A*B`; with `gate`, every call waits for it first."""

    def __init__(self, gate: threading.Event | None = None, output: str | None = None) -> None:
        self.gate = gate
        self.output = output
        self.calls: list[tuple[str, str]] = []

    def run(self, name, arguments):
        self.calls.append((name, arguments))
        if self.gate is not None:
            self.gate.wait(10)
        if self.output is not None:
            return ToolResult(self.output, "", 0.5)
        a, b = arguments.split("*")
        return ToolResult(str(int(a) * int(b)), "", 0.5)


PROMPT = Prompt(prompt_id="p", prompt_token_ids=[19, 20])
TOOLS = ToolsConfig(custom={"calc": "math:prod"}, max_turns=3, max_output_tokens=8)


def call_tokens(expression: str) -> list[int]:
    """`<tool_call>calc:EXPR</tool_call>` as the model samples it."""
    return [CALL, CALC, COLON, *Tokenizer().encode(expression), END]


def response_tokens(output: str) -> list[int]:
    return [RESP, *digits(output), RESP_END]


def _params(sample, max_tokens):
    return SimpleNamespace(max_tokens=max_tokens)


def make_loop(scripts, tools=TOOLS, toolbox=None, samples=1, budget=32, per_step=2):
    engine = ScriptedEngine(scripts, per_step, piece=VOCAB.__getitem__)
    agent = AgentLoop(tools, RewardConfig(), Tokenizer(), toolbox=toolbox or ScriptedTools())
    loop = DecodeLoop(engine, _params, samples, budget, worker_id=0, on_request_end=agent)
    return engine, agent, loop


def run_to_end(loop, version=0, limit_s=10.0):
    groups, deadline = [], time.monotonic() + limit_s
    while loop.has_unfinished():
        assert time.monotonic() < deadline, "the decode loop did not finish"
        groups += loop.step(version)
    return groups


def test_a_tool_call_continues_on_the_exact_prefix_with_the_tool_tokens_as_context():
    # turn 1 samples `<tool_call>calc:12*3</tool_call>` (8 tokens); the tool answers 36, rendered as
    # `<tool_response>36</tool_response>` (4 tokens); turn 2 starts from prompt + those 12 tokens with 32 - 12 = 20
    # tokens left and samples `7` then `a`
    turn1, tool, turn2 = call_tokens("12*3"), response_tokens("36"), digits("7") + [ID["a"]]
    engine, agent, loop = make_loop({"g/0": turn1, "g/0/1": turn2})
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    t = group.trajectories[0]
    assert t.response_token_ids == turn1 + tool + turn2
    assert engine.added[1] == ("g/0/1", [19, 20, *turn1, *tool], 32 - 12)
    assert t.loss_mask == [True] * 8 + [False] * 4 + [True] * 2
    assert t.behavior_logprobs == pytest.approx([-x / 10 for x in turn1] + [0.0] * 4 + [-x / 10 for x in turn2])
    assert t.token_versions == [0] * 8 + [-1] * 4 + [0] * 2
    (call,) = t.tool_calls
    assert (call.name, call.arguments, call.output, call.error) == ("calc", "12*3", "36", "")
    assert (call.output_start, call.output_tokens, call.seconds) == (8, 4, 0.5)
    assert t.response_text == "<tool_call>calc:12*3</tool_call><tool_response>36</tool_response>7a"
    assert t.final_text == "7a" and t.finish_reason == "stop" and t.num_turns == 2
    assert agent.report() == {**agent.report(), "calls": 1, "malformed_calls": 0, "seconds": 0.5}


def test_a_sample_waiting_on_a_tool_gives_up_its_engine_slot_and_its_later_turn_carries_the_new_version():
    # sample 0 calls a tool that waits on a gate; sample 1 keeps decoding meanwhile (at versions 0, 0, then 1 once
    # the weights changed); the gate opens at version 2, so sample 0's second turn is stamped 2
    gate = threading.Event()
    turn1 = call_tokens("2*3")
    scripts = {"g/0": turn1, "g/0/1": digits("6"), "g/1": digits("123456789012")}
    engine, agent, loop = make_loop(scripts, toolbox=ScriptedTools(gate), samples=2, per_step=4)
    loop.start_group("g", PROMPT)
    assert loop.step(0) == [] and loop.step(0) == []  # sample 0's call (7 tokens) ends in step 2
    assert list(engine.live) == ["g/1"] and agent.waiting == 1 and list(loop.waiting) == [("g", 0)]
    assert loop.step(1) == []  # sample 1 decodes on while the tool runs; it finishes in this step
    assert engine.live == {} and loop.has_unfinished()
    assert loop.step(1) == [] and not loop.decoded  # nothing to decode: the step only waited
    gate.set()
    (group,) = run_to_end(loop, version=2)
    t0, t1 = group.trajectories
    assert t0.token_versions == [0] * 7 + [-1] * 3 + [2]
    assert t1.token_versions == [0] * 8 + [1] * 4 and t1.tool_calls is None


def test_the_response_budget_spans_every_turn_and_a_tool_segment_is_cut_to_what_is_left():
    # budget 12: turn 1 is 7 tokens, leaving 5; the tool's 6-digit output renders to 8 tokens, cut to 5: the
    # sample ends `length` with no room for an answer, and the cut is counted
    turn1 = call_tokens("2*3")
    _, agent, loop = make_loop({"g/0": turn1}, toolbox=ScriptedTools(output="123456"), budget=12)
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    t = group.trajectories[0]
    assert len(t.response_token_ids) == 12 and t.response_token_ids[7:] == response_tokens("123456")[:5]
    assert t.finish_reason == "length" and t.truncated and t.loss_mask == [True] * 7 + [False] * 5
    assert agent.counts["budget_cut_outputs"] == 1 and agent.counts["truncated_outputs"] == 0


def test_a_continuation_may_sample_only_what_the_budget_has_left():
    # budget 14: 7 call tokens + 3 tool tokens leave 4 for turn 2, whose script wants 6: it ends `length`
    turn1 = call_tokens("2*3")
    engine, _, loop = make_loop({"g/0": turn1, "g/0/1": digits("123456")}, budget=14)
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    assert engine.added[-1][2] == 4
    assert group.trajectories[0].response_token_ids[-4:] == digits("1234")
    assert group.trajectories[0].finish_reason == "length"


def test_a_tool_output_over_the_cap_is_cut_and_counted():
    # tools.max_output_tokens=3: `123456` is cut to `123`, rendered to 5 tokens
    tools = TOOLS.model_copy(update={"max_output_tokens": 3})
    _, agent, loop = make_loop({"g/0": call_tokens("2*3"), "g/0/1": digits("9")}, tools=tools,
                               toolbox=ScriptedTools(output="123456"))
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    (call,) = group.trajectories[0].tool_calls
    assert call.output == "123" and call.output_truncated and call.output_tokens == 5
    assert agent.counts["truncated_outputs"] == 1


def test_a_model_that_keeps_calling_stops_at_max_turns_and_is_marked_truncated():
    # max_turns 3: turns 1 and 2 call and get answers; turn 3 calls again, so the sample ends there (max_turns)
    call = call_tokens("2*2")
    scripts = {"g/0": call, "g/0/1": call, "g/0/2": call}
    _, agent, loop = make_loop(scripts, budget=64)
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    t = group.trajectories[0]
    assert t.finish_reason == "max_turns" and t.truncated and t.num_turns == 3
    assert t.response_token_ids == call + response_tokens("4") + call + response_tokens("4") + call
    assert agent.counts["max_turns"] == 1 and agent.counts["calls"] == 2


def test_a_malformed_call_ends_the_turn_as_a_plain_response_and_is_counted():
    # `<tool_call>calc12</tool_call>` has no `:` after the name; sample 1's plain answer is not affected
    bad = [CALL, CALC, *digits("12"), END]
    tools = ScriptedTools()
    _, agent, loop = make_loop({"g/0": bad, "g/1": digits("42")}, toolbox=tools, samples=2)
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    t0, t1 = group.trajectories
    assert t0.response_token_ids == bad and t0.finish_reason == "stop" and t0.tool_calls is None
    assert t0.malformed_call and not t1.malformed_call  # the loop's verdict travels with the sample
    assert t1.response_text == "42" and tools.calls == []
    assert agent.counts["malformed_calls"] == 1 and agent.counts["calls"] == 0


def test_a_call_nested_1000_deep_is_counted_malformed_and_never_reaches_the_worker():
    # the turn ends at `</tool_call>` with a JSON body 1001 levels deep: parse_call refuses it (no RecursionError)
    agent = AgentLoop(TOOLS, RewardConfig(), Tokenizer(), toolbox=ScriptedTools())
    text = '<tool_call>{"name": "calc", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"
    try:
        assert agent(None, SimpleNamespace(outputs=[SimpleNamespace(text=text)])) == Finished(malformed_call=True)
        assert agent.counts["malformed_calls"] == 1 and agent.counts["calls"] == 0
    finally:
        agent.close()


def test_an_unknown_tool_or_a_failing_one_answers_with_its_error_text_and_the_sample_goes_on():
    # the real ToolBox: `nope` is not a tool (unknown_tool); the calculator refuses `2*` (exception)
    tools = ToolsConfig(builtin=["calculator"], max_output_tokens=64)
    unknown = [CALL, ID["nope"], COLON, *digits("1"), END]
    failing = [CALL, ID["calculator"], COLON, *digits("2"), TIMES, END]
    scripts = {"g/0": unknown, "g/0/1": digits("1"), "g/1": failing, "g/1/1": digits("2")}
    _, agent, loop = make_loop(scripts, tools=tools, toolbox=ToolBox(tools, RewardConfig()), samples=2, budget=200)
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    (unknown_call,), (failing_call,) = (t.tool_calls for t in group.trajectories)
    assert unknown_call.error == "unknown_tool" and "calculator" in unknown_call.output
    assert failing_call.error == "exception" and failing_call.output
    assert [t.final_text for t in group.trajectories] == ["1", "2"]
    assert agent.counts["errors_unknown_tool"] == 1 and agent.counts["errors_exception"] == 1


def test_a_tool_past_its_time_is_answered_timeout_by_the_loop(monkeypatch):
    # a tool stuck where the ToolBox cannot stop it: the loop answers `timeout` after timeout_s + the grace
    monkeypatch.setattr(agent_loop_module, "TIMEOUT_GRACE_S", 0.0)
    gate = threading.Event()
    tools = TOOLS.model_copy(update={"timeout_s": 0.05, "max_output_tokens": 64})
    _, agent, loop = make_loop({"g/0": call_tokens("2*3"), "g/0/1": digits("1")}, tools=tools,
                               toolbox=ScriptedTools(gate))
    loop.start_group("g", PROMPT)
    (group,) = run_to_end(loop)
    gate.set()
    (call,) = group.trajectories[0].tool_calls
    assert call.error == "timeout" and "timeout_s=0.05" in call.output
    assert agent.counts["errors_timeout"] == 1
    agent.close()


def test_abort_with_tools_in_flight_forgets_the_waiting_samples():
    gate = threading.Event()
    engine, agent, loop = make_loop({"g/0": call_tokens("2*3"), "h/0": digits("1234567890123")},
                                    toolbox=ScriptedTools(gate), per_step=8)
    loop.start_group("g", PROMPT)
    loop.start_group("h", PROMPT)
    loop.step(0)
    assert agent.waiting == 1 and list(engine.live) == ["h/0"]
    assert loop.abort() == ["g", "h"]
    assert agent.waiting == 0 and loop.waiting == {} and engine.live == {} and not loop.has_unfinished()
    gate.set()  # the tool's thread finishes; nothing comes back
    assert loop.step(1) == [] and agent.ready() == []
    agent.close()


def test_with_tools_the_worker_stops_a_turn_after_the_call_tag_and_keeps_it_in_the_output():
    from actors.decode_loop import SampleInFlight
    from actors.rollout_worker import RolloutWorker
    from protocols.config import RunConfig

    sample = SampleInFlight("g", 0, PROMPT, max_response_tokens=16)
    with_tools = SimpleNamespace(cfg=RunConfig(tools={"builtin": ["calculator"]}))
    params = RolloutWorker._sampling_params(with_tools, sample, 16)
    assert params.stop == ["</tool_call>"] and params.include_stop_str_in_output
    params = RolloutWorker._sampling_params(SimpleNamespace(cfg=RunConfig()), sample, 16)
    assert not params.stop and not params.include_stop_str_in_output
