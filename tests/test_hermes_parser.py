"""Hermes tool calls (gateway/hermes.py) read as vLLM's `hermes` parser reads them: the same content, names and
argument text on the same model output, for well-formed, broken and hostile turns; and bounded where vLLM is not."""

import pytest

from gateway.hermes import parse_hermes
from rewards.tool_calls import MAX_CALL_CHARS
from tests.tiny_chat_tokenizer import build_chat_tokenizer

TEXTS = [
    "The answer is 4.",                                                            # no call
    "",                                                                            # empty turn
    '<tool_call>\n{"name": "calc", "arguments": {"e": "12*3"}}\n</tool_call>',     # one call, no content
    'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"e": "1+1"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2.5, null, true]}}\n</tool_call>',         # two calls
    '<tool_call>\n{"name": "calc", "arguments": {"e": "2*2"}}',                    # unclosed last call
    '<tool_call>{"name": "w", "arguments": {"city": "Zürich", "q": "\\u00e9"}}</tool_call>',  # non-ASCII kept
    '<tool_call>{"name": "s", "arguments": "plain text"}</tool_call>',             # string arguments
    '<tool_call>{"arguments": {"b": 1, "a": 2}, "name": "k"}</tool_call> trailing',  # key order kept
    '<tool_call>\n{"name": "calc", "arguments": {"e": \n</tool_call>',             # bad JSON: plain content
    '<tool_call>{"name": "calc"}</tool_call>',                                     # no arguments
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',                         # name not a string
    '<tool_call>[1, 2]</tool_call>',                                               # not an object
    "<tool_call></tool_call>",                                                     # empty region
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>',  # one bad: none read
    '<tool_call>{"name": "a", "arguments": {}}<tool_call>{"name": "b", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "n", "arguments": {"v": 1e400}}</tool_call>',             # inf written back as Infinity
    '<tool_call>{"name": "n", "arguments": {"v": ' + "9" * 5000 + "}}</tool_call>",  # past the int-from-text limit
    "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>",                # RecursionError in vLLM
    "</tool_call> stray close, no open",
]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_hermes(tmp_path_factory):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    parser = Hermes2ProToolParser(build_chat_tokenizer(tmp_path_factory.mktemp("tok")))
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    return lambda text: parser.extract_tool_calls(text, request)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_hermes_calls_match_vllms_parser(vllm_hermes, text):
    theirs = vllm_hermes(text)
    ours = parse_hermes(text)
    assert ours.content == theirs.content
    assert bool(ours.tool_calls) == theirs.tools_called
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in ours.tool_calls] == [
        (c.function.name, c.function.arguments) for c in theirs.tool_calls]
    # a failure is named wherever a call was tried and not read
    assert bool(ours.error) == ("<tool_call>" in text and not theirs.tools_called)


def test_a_reply_with_calls_is_an_openai_assistant_message():
    reply = parse_hermes('ok<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "call_s1_0")
    assert reply.message() == {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "call_s1_0_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}


def test_a_call_past_the_size_bound_is_refused_where_vllm_would_read_it():
    # 100,001 characters of string argument: valid JSON, refused unread (a bound on what one call hands a tool)
    text = '<tool_call>{"name": "f", "arguments": {"s": "' + "x" * MAX_CALL_CHARS + '"}}</tool_call>'
    reply = parse_hermes(text)
    assert reply.tool_calls == [] and reply.content == text and "at most 100000" in reply.error


def test_nesting_past_the_depth_bound_is_refused_before_the_decoder():
    reply = parse_hermes('<tool_call>{"name": "f", "arguments": ' + "[" * 65 + "]" * 65 + "}</tool_call>")
    assert reply.tool_calls == [] and "66 levels" in reply.error  # the object's brace + 65 brackets


def test_a_call_no_response_can_carry_is_refused_as_unread_text():
    # an escape that decodes to a lone surrogate: no UTF-8 response body could hold the arguments
    reply = parse_hermes('<tool_call>{"name": "f", "arguments": {"e": "\\ud800"}}</tool_call>')
    # it stays the turn's content, as any call that is not read, and that content is text a response can carry
    assert reply.tool_calls == [] and "lone surrogate" in reply.error
    assert reply.content.encode("utf-8").startswith(b"<tool_call>")


def test_a_stream_holds_back_what_may_start_a_tool_call_and_a_partial_character():
    from gateway.replies import streamable as _streamable

    # with tools: text before a call goes; from `<tool_call>` on, or a tail that may begin it, waits
    assert _streamable("The answer <tool_call>{", True) == "The answer "
    assert _streamable("The answer <tool_ca", True) == "The answer "
    assert _streamable("a < b", True) == "a < b"  # `< b` cannot begin `<tool_call>`
    assert _streamable("a <", True) == "a "
    # without tools every character goes, but a partial UTF-8 character (decoded as U+FFFD) waits for its bytes
    assert _streamable("The answer <tool_ca", False) == "The answer <tool_ca"
    assert _streamable("caf\ufffd", False) == "caf"
    # a tail that may begin a stop string waits too: a stream never sends what the stop cuts
    assert _streamable("Thought: x\nObs", False, ("Observation:",)) == "Thought: x\n"
