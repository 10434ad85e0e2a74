"""The built-in agent loop in the model's own tool format (tools.call_format: hermes), as a client of the session
endpoint's code: the prompt holds the tools' schemas through the chat template, a turn's Hermes calls are read as
vLLM's parser reads them, and the outputs go back as `tool` messages rendered by the template after the turn's end.
A scripted engine plays the model (tests/test_decode_loop.py); the tokenizer has Qwen2.5's template."""

import time

import pytest

from actors.agent_loop import AgentLoop
from actors.decode_loop import DecodeLoop
from protocols.reward import RewardConfig
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt
from tests.test_decode_loop import ScriptedEngine, _params
from tests.tiny_chat_tokenizer import build_chat_tokenizer

TOOLS = ToolsConfig(builtin=["calculator"], call_format="hermes", max_turns=3, max_output_tokens=8)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("qwen25"))


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def call(expression):
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'


def run(tok, scripts):
    """One sample through the decode loop and the agent loop (the real calculator); the trajectory and engine."""
    prompt_text = tok.apply_chat_template([{"role": "user", "content": "12*3?"}], tools=TOOLS.schemas(),
                                          tokenize=False, add_generation_prompt=True)
    prompt = Prompt(prompt_id="p", prompt_token_ids=ids(tok, prompt_text))
    engine = ScriptedEngine(scripts, per_step=64, piece=lambda t: tok.decode([t], skip_special_tokens=True))
    agent = AgentLoop(TOOLS, RewardConfig(), tok)
    loop = DecodeLoop(engine, _params, 1, 256, 0, on_request_end=agent)
    loop.start_group("g", prompt)
    groups = []
    deadline = time.monotonic() + 30
    while not groups and time.monotonic() < deadline:
        groups = loop.step(0)
    agent.close()
    return prompt, groups[0].trajectories[0], engine, agent


def test_a_hermes_call_is_answered_as_a_tool_message_the_template_renders(tok):
    end = ids(tok, "<|im_end|>")
    s1, s2 = ids(tok, call("12*3")) + end, ids(tok, "36") + end
    prompt, t, engine, agent = run(tok, {"g/0": s1, "g/0/1": s2})
    assert '"name": "calculator"' in tok.decode(prompt.prompt_token_ids)  # the schema is in the system turn
    # the tool segment is the template's: the rest of the turn's close, the tool turn, the generation prompt
    segment = ids(tok, "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert engine.added[1][1] == prompt.prompt_token_ids + s1 + segment
    assert t.response_token_ids == s1 + segment + s2
    assert t.loss_mask == [True] * len(s1) + [False] * len(segment) + [True] * len(s2)
    (record,) = t.tool_calls
    assert (record.name, record.arguments, record.output, record.error) == ("calculator", "12*3", "36", "")
    assert t.final_text == "36" and agent.counts["calls"] == 1


def test_two_calls_of_one_turn_go_back_as_one_tool_turn(tok):
    end = ids(tok, "<|im_end|>")
    s1, s2 = ids(tok, call("2*3") + "\n" + call("4+5")) + end, ids(tok, "6 9") + end
    prompt, t, engine, _ = run(tok, {"g/0": s1, "g/0/1": s2})
    segment = ids(tok, "\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\n9\n"
                       "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert t.response_token_ids == s1 + segment + s2
    assert [(c.arguments, c.output, c.output_tokens) for c in t.tool_calls] == [
        ("2*3", "6", len(segment)), ("4+5", "9", 0)]


def test_a_call_that_does_not_parse_ends_the_sample_counted(tok):
    end = ids(tok, "<|im_end|>")
    _, t, _, agent = run(tok, {"g/0": ids(tok, "<tool_call>\n{not json}\n</tool_call>") + end})
    assert t.malformed_call and t.tool_calls is None and agent.counts["malformed_calls"] == 1


def test_the_data_loader_writes_the_tools_schemas_into_each_prompt(tok):
    from protocols.data import DataConfig
    from rewards.datasets import encode_prompt

    with_tools = encode_prompt("12*3?", DataConfig(), tok, TOOLS.template_tools())
    assert with_tools == ids(tok, tok.apply_chat_template([{"role": "user", "content": "12*3?"}],
                                                          tools=TOOLS.schemas(), tokenize=False,
                                                          add_generation_prompt=True))
    assert ToolsConfig(builtin=["calculator"]).template_tools() is None  # the tagged format: no schemas
    assert len(encode_prompt("12*3?", DataConfig(), tok)) < len(with_tools)
