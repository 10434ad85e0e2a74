"""The agent demo's pieces (demos/agent_task.py, demos/products_agent.py), pure: the demo tokenizer's chat template
writes the real Hermes format in few tokens, the session endpoint's template delta works with it, the warm start's
conversations are the tokens an endpoint episode holds, and the built-in agent loop (held-out evaluation) builds
the same prompt as the agent's sessions."""

import json

import pytest

from demos.agent_task import (CALCULATOR_SCHEMA, CALL_HEAD, CALL_TAIL, call_message, hermes_example, read_call,
                              uses_hermes)
from demos.arithmetic_model import build_tokenizer, demo_model_key, vocabulary
from demos.products_agent import TOOLS, run_tool
from gateway.chat_render import ChatRenderer
from gateway.episode import ChatCall, Episode
from gateway.hermes import parse_hermes
from protocols.data import DataConfig
from protocols.model import DemoModelConfig
from protocols.tools import ToolsConfig
from rewards.datasets import encode_prompt

HERMES = ToolsConfig(builtin=["calculator"], call_format="hermes")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("agent_tok")
    build_tokenizer(folder, HERMES)
    return AutoTokenizer.from_pretrained(str(folder))  # as vLLM and the endpoint load it


def tokens(tokenizer, ids):
    return tokenizer.convert_ids_to_tokens(ids)


def test_the_tool_demo_vocabulary_and_cache_key_are_unchanged_by_the_agent_demo():
    tagged = ToolsConfig()
    # the agent demo appends its 4 words after the tool demo's 22 tokens (15 symbols, `*`, `:`, 5 tool words)
    assert vocabulary(HERMES)[:22] == vocabulary(tagged) and len(vocabulary(HERMES)) == 26
    demo, data = DemoModelConfig(tool_share=0.3), DataConfig(arithmetic_op="*", arithmetic_min_operand=100)
    assert demo_model_key(demo, data, HERMES) != demo_model_key(demo, data, tagged)
    assert uses_hermes(HERMES) and not uses_hermes(tagged)


def test_the_template_renders_a_tool_episode_as_hermes_json_in_few_tokens(tokenizer):
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "123*4567="}, call_message(123, 4567, "*"),
                {"role": "tool", "content": "561741"}, {"role": "assistant", "content": "561741"}]
    text = renderer.render(messages, [CALCULATOR_SCHEMA], {}, generation_prompt=False)
    assert text == ('<bos><tools>calculator</tools>123*4567=<tool_call>{"name": "calculator", "arguments": '
                    '{"expression": "123*4567"}}</tool_call><eos><tool_response>561741</tool_response>561741<eos>')
    ids = renderer.encode(text)
    # prompt 4 + 9 characters; call: <tool_call>, head, 8 characters, tail, </tool_call>, <eos>; tool: 1 + 6 + 1;
    # answer 6 + <eos>: 13 + 13 + 8 + 7 = 41
    assert len(ids) == 41
    assert tokens(tokenizer, ids[13:16]) == ["<tool_call>", CALL_HEAD, "1"]
    assert tokens(tokenizer, ids[23:26]) == [CALL_TAIL, "</tool_call>", "<eos>"]
    # the model's turn, as vLLM decodes it (special tokens skipped), is what vLLM's hermes parser reads
    reply = parse_hermes(tokenizer.decode(ids[13:26], skip_special_tokens=True))
    assert reply.error == "" and reply.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == [
        ("calculator", {"expression": "123*4567"})]


def test_the_template_delta_of_a_tool_result_is_the_response_block_only(tokenizer):
    renderer = ChatRenderer(tokenizer)
    delta = renderer.delta_ids([{"role": "tool", "content": "561741"}], [CALCULATOR_SCHEMA], {})
    assert tokens(tokenizer, delta) == ["<tool_response>", *"561741", "</tool_response>"]
    # a user turn after a reply is its text; no generation prompt follows (the model answers after the text)
    assert tokens(tokenizer, renderer.delta_ids([{"role": "user", "content": "12="}], None, {})) == [*"12="]


def test_a_warm_start_conversation_is_the_template_rendering_with_loss_on_the_model_turns(tokenizer):
    renderer = ChatRenderer(tokenizer)
    ids, mask = hermes_example(123, 4567, "*", tokenizer, call=True)
    messages = [{"role": "user", "content": "123*4567="}, call_message(123, 4567, "*"),
                {"role": "tool", "content": "561741"}, {"role": "assistant", "content": "561741"}]
    assert ids == renderer.encode(renderer.render(messages, [CALCULATOR_SCHEMA], {}, generation_prompt=False))
    # loss on the 13 call tokens and the 7 answer tokens; none on the 13 prompt and 8 tool-result tokens
    assert mask == [False] * 13 + [True] * 13 + [False] * 8 + [True] * 7
    direct, direct_mask = hermes_example(123, 4567, "*", tokenizer, call=False)
    assert direct == ids[:13] + ids[-7:] and direct_mask == [False] * 13 + [True] * 7


def test_an_endpoint_episode_and_the_built_in_loop_build_the_same_tokens(tokenizer):
    """The agent's sessions (gateway/episode.py) and held-out evaluation (the data loader's prompt, then the
    agent loop's `tool` delta after the turn's end) see the same ids for the same turns."""
    renderer = ChatRenderer(tokenizer)
    episode = Episode(renderer)
    user = [{"role": "user", "content": "123*4567="}]
    first = ChatCall(user, TOOLS)
    plan = episode.plan(first)
    data_prompt = encode_prompt("123*4567=", DataConfig(format="arithmetic"), tokenizer, HERMES.template_tools())
    assert plan.prompt_ids == data_prompt
    sampled = renderer.encode(f"<tool_call>{CALL_HEAD}123*4567{CALL_TAIL}</tool_call>") + renderer.turn_end_ids
    reply = parse_hermes(tokenizer.decode(sampled, skip_special_tokens=True)).message()
    episode.record(first, plan, reply, sampled, [0.0] * len(sampled), [0] * len(sampled), "stop")
    # the agent sends back the SDK's message (content None dropped) and its tool result
    second = ChatCall([*user, {k: v for k, v in reply.items() if v is not None},
                       {"role": "tool", "tool_call_id": "call_0", "content": "561741"}], TOOLS)
    plan2 = episode.plan(second)
    assert plan2.parent == 0 and plan2.split_reason is None
    assert plan2.prompt_ids == [*data_prompt, *sampled,
                                *renderer.delta_ids([{"role": "tool", "content": "561741"}], None, {})]


def test_read_call_takes_only_a_calculator_call_with_a_string_expression():
    assert read_call(f'<tool_call>{CALL_HEAD}12*34{CALL_TAIL}</tool_call>') == "12*34"
    assert read_call("5678") is None  # a plain answer
    assert read_call('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>') is None
    assert read_call('<tool_call>{"name": "python", "arguments": {"expression": "1"}}</tool_call>') is None
    assert read_call('<tool_call>{"name": "calculator", "arguments": {"expression": "1"</tool_call>') is None


def test_the_agents_tool_runs_the_calculator_and_answers_bad_calls_with_text():
    assert run_tool("calculator", '{"expression": "123*4567"}') == "561741"
    assert run_tool("calculator", '{"expression": "1/0"}').startswith("error: ")
    assert run_tool("calculator", "not json").startswith("error: ")
    assert run_tool("search", "{}") == "error: unknown tool 'search'"
    # the agent's schema is the one the built-in calculator offers
    assert TOOLS == [CALCULATOR_SCHEMA]
