"""JSON read back from outside: a function-call result the code verifier reads (the JSON the program returned) that
nests past the decoder's recursion limit or holds a number past Python's int-from-text limit is a wrong answer, never
an exception; a session client's tool-call arguments of that kind stay text. (The bounds of the other parsers are
tested beside them: test_tool_calls, test_tools, test_math_verifier, test_gsm8k_verifier, test_hermes_parser; a
verifier's info JSON cannot hold: test_scorer.)"""

import json

import pytest

from protocols.reward import CodeSandboxConfig
from rewards import code_sandbox
from rewards.code_sandbox import RunResult, run_test


@pytest.mark.parametrize("returned", [
    "[" * 100_000 + "]" * 100_000,   # 100,000 levels: json.loads raises RecursionError
    "1" * 5000,                      # 5000 digits: json.loads raises ValueError (the 4300-digit limit)
    "not json",                      # JSONDecodeError
])  # fmt: skip
def test_a_function_result_json_cannot_read_is_a_wrong_answer(monkeypatch, returned):
    def fake_run(code, cfg, stdin="", fn_name="", args=None, timeout_s=None):
        return RunResult(status="ok", stdout="", stderr="", result=returned, seconds=0.0)

    monkeypatch.setattr(code_sandbox, "run_in_sandbox", fake_run)
    test = {"fn_name": "f", "args": [], "output": [1]}
    assert run_test("def f(): ...", test, CodeSandboxConfig(), 1.0) == (False, "wrong_answer")



@pytest.mark.parametrize("arguments", [
    "[" * 100_000 + "]" * 100_000,   # past the decoder's recursion limit
    '{"n": ' + "1" * 5000 + "}",     # past the int-from-text limit
    "not json",
])  # fmt: skip
def test_a_clients_tool_call_arguments_json_cannot_read_stay_text(arguments):
    """A client's messages go back into the chat template and decide which earlier call a call extends; arguments
    the decoder cannot read (or is not asked to: deeper than MAX_JSON_DEPTH) stay the text the client sent."""
    from gateway.chat_render import canonical_message, openai_to_template

    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
    assert openai_to_template(message)["tool_calls"][0]["function"]["arguments"] == arguments
    assert canonical_message(message)[-1] == (("f", json.dumps(arguments)),)


def test_a_clients_tool_call_arguments_within_bounds_are_read_as_the_object():
    from gateway.chat_render import canonical_message, openai_to_template

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"b": [1], "a": 2}'}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert openai_to_template(message)["tool_calls"][0]["function"]["arguments"] == {"b": [1], "a": 2}
    assert canonical_message(message)[-1] == (("f", '{"a": 2, "b": [1]}'),)


def test_a_request_body_past_gateway_max_request_bytes_is_answered_413_and_the_endpoint_serves_on(tmp_path):
    """The body is refused as it passes the bound, declared (Content-Length) or not (chunked), never held whole."""
    import httpx

    from gateway.chat_render import ChatRenderer
    from gateway.engine_bridge import CallInbox
    from gateway.server import GatewayServer, ServeSettings
    from gateway.sessions import SessionBook
    from tests.tiny_chat_tokenizer import build_chat_tokenizer

    book = SessionBook(ChatRenderer(build_chat_tokenizer(tmp_path)), "extend", max_sessions=8, timeout_s=30.0,
                       train_group_size=1)
    settings = ServeSettings(model_name="relayrl", max_tokens=8, max_model_len=64, max_calls_in_flight=4,
                             retry_after_s=1, max_request_bytes=4096)
    server = GatewayServer(book, CallInbox(lambda max_tokens, options: None), settings).start()
    try:
        big = b'{"group": "' + b"x" * 10_000 + b'"}'
        r = httpx.post(f"{server.url}/sessions", content=big)
        assert r.status_code == 413 and "gateway.max_request_bytes=4096" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/sessions", content=iter([big[:3000], big[3000:]]))  # no declared length
        assert r.status_code == 413
        assert httpx.post(f"{server.url}/sessions", json={"group": "g"}).status_code == 200
    finally:
        server.stop()
