"""Every field of the OpenAI SDK's own request types is served or refused by name (gateway/request_fields.py), and
docs/agents.md lists each with what the endpoint does. Pure: the SDK's TypedDicts are walked, no server runs."""

import typing
from pathlib import Path

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from gateway.replies import cut_at_stop
from gateway.request_fields import (CHAT_FIELDS, COMPLETION_FIELDS, VLLM_FIELDS, CallOptions, Sampling, fields,
                                    read_options)
from gateway.sessions import SessionError

RUN = Sampling(temperature=1.0, top_p=1.0)
BASE = {"chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "completions": {"model": "m",
                                                                                              "prompt": "hi"}}

REFUSED = {
    "chat": {"temperature": 0.7, "top_p": 0.9, "frequency_penalty": 0.1, "presence_penalty": -0.5,
             "logit_bias": {"5": 10}, "response_format": {"type": "json_object"}, "tool_choice": "required",
             "parallel_tool_calls": False, "functions": [{"name": "f"}], "function_call": "auto",
             "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
             "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
             "web_search_options": {"search_context_size": "low"}, "moderation": {"model": "x"}, "store": False,
             "n": 17, "top_logprobs": 3, "stop": ["a", "b", "c", "d", "e"], "seed": -1, "max_tokens": 0,
             "max_completion_tokens": "10", "stream_options": {"include_obfuscation": True}},
    "completions": {"temperature": 0.0, "best_of": 3, "echo": True, "suffix": "end", "logprobs": 6, "n": 0,
                    "logit_bias": {"5": -100}, "frequency_penalty": 1.0},
}
"""A value of each field that the endpoint must refuse, naming the field (None: none exists, always served)."""

VLLM_REFUSED = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "length_penalty": 0.5, "use_beam_search": True,
                "min_tokens": 3, "ignore_eos": True, "skip_special_tokens": False,
                "spaces_between_special_tokens": False, "add_generation_prompt": False, "continue_final_message": True,
                "echo": True, "priority": 2, "prompt_logprobs": 1, "guided_json": {"type": "object"},
                "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= x",
                "structured_outputs": {"json": {}}, "allowed_token_ids": [1, 2], "bad_words": ["x"],
                "truncate_prompt_tokens": 10}


def sdk_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsNonStreaming)) | set(
        typing.get_type_hints(module.CompletionCreateParamsStreaming))


@pytest.mark.parametrize("route,module,table", [("chat", chat_params, CHAT_FIELDS),
                                                ("completions", completion_params, COMPLETION_FIELDS)])
def test_every_field_of_the_sdks_request_types_is_in_the_table(route, module, table):
    assert sdk_fields(module) == set(table)  # a field the SDK adds fails here until the table says what it does


def refused_param(route: str, body: dict) -> str:
    with pytest.raises(SessionError) as err:
        read_options({**BASE[route], **body}, route, RUN)
    assert err.value.status == 400
    return err.value.param


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_each_refusable_field_is_refused_by_name_and_the_rest_served(route):
    table = fields(route)
    for name, text in table.items():
        value = REFUSED[route].get(name, VLLM_REFUSED.get(name))
        if value is None:
            assert text.startswith("served"), name  # never refused: the table must say so
            continue
        assert refused_param(route, {name: value}).split(".")[0] == name, name  # (top_logprobs: without logprobs)
    with pytest.raises(SessionError) as err:
        read_options({**BASE[route], "frobnicate": 1}, route, RUN)
    assert err.value.param == "frobnicate" and "unknown field" in err.value.message


def test_served_fields_become_the_calls_options():
    chat = read_options({**BASE["chat"], "n": 3, "stop": "Observation:", "seed": 7, "logprobs": True,
                         "top_logprobs": 2, "max_tokens": 9, "max_completion_tokens": 5, "temperature": 1.0,
                         "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
                         "metadata": {"k": "v"}, "tool_choice": "auto", "response_format": {"type": "text"},
                         "top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "include_stop_str_in_output": True,
                         "return_token_ids": True, "parallel_tool_calls": True, "store": True}, "chat", RUN)
    assert chat == CallOptions(max_tokens=5, n=3, stop=("Observation:",), seed=7, top_logprobs=2,
                               return_token_ids=True, stream=True, include_usage=True, keep_stop=True,
                               recorded=(("metadata", {"k": "v"}), ("user", "u1")))
    assert read_options(BASE["chat"], "chat", RUN).top_logprobs is None  # no logprobs asked: none sent
    assert read_options({**BASE["chat"], "logprobs": True}, "chat", RUN).top_logprobs == 0
    legacy = read_options({**BASE["completions"], "logprobs": 3, "best_of": 2, "n": 2, "echo": False},
                          "completions", RUN)
    assert (legacy.top_logprobs, legacy.n) == (3, 2)
    assert read_options({**BASE["chat"], "temperature": None, "n": None}, "chat", RUN).n == 1  # null: left out


def test_a_refusal_says_why_and_what_to_send():
    with pytest.raises(SessionError) as err:
        read_options({**BASE["chat"], "temperature": 0.2}, "chat", RUN)
    assert "rollout.temperature=1" in err.value.message and "Leave it out, or send 1" in err.value.message


def test_a_stop_string_ends_the_text_where_it_starts_or_with_it_kept():
    assert cut_at_stop("Thought: x\nObservation: y", ("Observation:", "\n")) == "Thought: x"
    assert cut_at_stop("Thought: x\nObservation: y", ("Observation:",), keep=True) == "Thought: x\nObservation:"
    assert cut_at_stop("no stop here", ("Observation:",)) == "no stop here"


def test_docs_list_every_field_of_both_routes():
    doc = (Path(__file__).parents[1] / "docs" / "agents.md").read_text()
    missing = [name for name in {**CHAT_FIELDS, **COMPLETION_FIELDS, **VLLM_FIELDS} if f"| `{name}` |" not in doc]
    assert not missing, f"docs/agents.md has no table row for {missing}"
