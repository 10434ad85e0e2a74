"""The tool demo's model pieces: tool vocabulary, product task, the warm start's tool examples, the cache key."""

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from demos.arithmetic_model import (
    SYMBOLS,
    build_random_model,
    build_tokenizer,
    demo_model_key,
    vocabulary,
    warm_start,
)
from demos.tool_task import (
    demo_calculator,
    greedy_tool_rollouts_hf,
    tool_example,
    tool_rollout_stats,
    tool_words,
)
from protocols.data import DataConfig
from protocols.model import DemoModelConfig
from protocols.tools import ToolsConfig
from rewards.arithmetic_data import arithmetic_problems, problem_answer, problem_text
from rewards.datasets import load_arithmetic_prompts

PRODUCTS = DataConfig(arithmetic_op="*", arithmetic_min_operand=100, arithmetic_max_operand=9999, num_eval_prompts=20)
CALL = "<tool_call>calculator:123*4567</tool_call><tool_response>561741</tool_response>561741"


def test_tool_tags_are_single_tokens_and_round_trip(tmp_path):
    tokenizer = build_tokenizer(tmp_path, ToolsConfig())
    # ids: 15 addition symbols, `*` 15, `:` 16, then <tool_call> 17, </tool_call> 18, <tool_response> 19,
    # </tool_response> 20, calculator 21
    assert len(tokenizer) == 22
    ids = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    # digit d is 3 + d: `123*4567` -> 4 5 6 15 7 8 9 10
    assert ids[:3] == [17, 21, 16] and ids[3:11] == [4, 5, 6, 15, 7, 8, 9, 10]
    assert ids[11:13] == [18, 19] and ids[19] == 20
    # The tags survive decoding with special tokens skipped (vLLM's output text, parsed by the agent loop).
    assert tokenizer.decode(ids, skip_special_tokens=True) == CALL
    assert tokenizer("123*4567=")["input_ids"] == [1, 4, 5, 6, 15, 7, 8, 9, 10, 14]


def test_model_folder_tokenizer_agrees_on_tool_text(tmp_path):
    # transformers loads the folder as a Qwen2Tokenizer (as vLLM does), rebuilt from the saved files.
    folder = build_random_model(tmp_path, tied=False, tools=ToolsConfig())
    auto = AutoTokenizer.from_pretrained(folder)
    plain = PreTrainedTokenizerFast.from_pretrained(folder)
    # (Characters outside the vocabulary, e.g. the letters of a tool's error text, differ: unknown to one, dropped
    # by the other; the demo's calls and outputs have none.)
    for text in (CALL, "123*4567=", "<tool_response>1234</tool_response>"):
        assert auto(text, add_special_tokens=False)["input_ids"] == plain(text, add_special_tokens=False)["input_ids"]
    assert auto.decode(auto(CALL, add_special_tokens=False)["input_ids"], skip_special_tokens=True) == CALL


def test_tool_words_follow_the_configured_tags():
    tools = ToolsConfig(call_start="[c]", call_end="[/c]", output_template="[o]{output}")
    # The template has no text after {output}: that empty word is dropped.
    assert tool_words(tools) == ["[c]", "[/c]", "[o]", "calculator"]
    assert vocabulary(None) == SYMBOLS and vocabulary(tools)[15:] == ["*", ":", "[c]", "[/c]", "[o]", "calculator"]


def test_product_task_prompts_and_answers():
    prompts, _ = load_arithmetic_prompts(PRODUCTS, "test", build_tokenizer_stub())
    assert len(prompts) == 20
    for p in prompts:
        a, b = (int(x) for x in p.prompt_text[:-1].split("*"))
        assert 100 <= a <= 9999 and 100 <= b <= 9999 and p.answer == str(a * b)
    assert problem_text(12, 34, "*") == "12*34=" and problem_answer(12, 34, "*") == "408"


def test_operand_range_must_not_be_empty():
    with pytest.raises(ValueError, match="data.arithmetic_min_operand=50 is above data.arithmetic_max_operand=9"):
        arithmetic_problems(9, "train", 10, min_operand=50)


def test_small_operand_range_is_enumerated_within_bounds():
    # Operands 10..19: 100 pairs, about 90 in the train split.
    pairs = arithmetic_problems(19, "train", 50, min_operand=10)
    assert len(set(pairs)) == 50 and all(10 <= a <= 19 and 10 <= b <= 19 for a, b in pairs)


def test_tool_example_masks_the_tool_output(tmp_path):
    tokenizer = build_tokenizer(tmp_path, ToolsConfig())
    ids, mask = tool_example(123, 4567, "*", tokenizer, ToolsConfig())
    # prompt `<bos>123*4567=` 10 tokens (no loss), call `<tool_call>calculator:123*4567</tool_call>` 12 (loss),
    # output `<tool_response>561741</tool_response>` 8 (context, no loss), answer 561741 and EOS 7 (loss)
    assert len(ids) == 10 + 12 + 8 + 7
    assert mask == [False] * 10 + [True] * 12 + [False] * 8 + [True] * 7
    assert tokenizer.decode(ids, skip_special_tokens=True) == "123*4567=" + CALL
    assert ids[-1] == tokenizer.eos_token_id


def test_demo_calculator_evaluates_the_taught_calls_only():
    assert demo_calculator("123*4567") == "561741" and demo_calculator("12+30") == "42"
    assert demo_calculator("12**3") == "error" and demo_calculator("") == "error"


def test_addition_demo_key_ignores_the_tool_settings():
    # The addition demo's cached model (and its measured figures) must not move with the tool demo's settings.
    base = demo_model_key(DemoModelConfig(), DataConfig())
    assert demo_model_key(DemoModelConfig(warm_start_target_call_rate=0.5), DataConfig()) == base
    assert demo_model_key(DemoModelConfig(), DataConfig(), ToolsConfig(builtin=["calculator"])) == base
    tool_demo = demo_model_key(DemoModelConfig(tool_share=0.3), PRODUCTS)
    assert tool_demo != base
    # The tool demo and its no-tools comparison start from one model; other tags build another.
    assert demo_model_key(DemoModelConfig(tool_share=0.3), PRODUCTS, ToolsConfig(builtin=["calculator"])) == tool_demo
    assert demo_model_key(DemoModelConfig(tool_share=0.3), PRODUCTS, ToolsConfig(call_start="<c>")) != tool_demo


def test_short_tool_warm_start_calls_the_tool(tmp_path):
    # Early in the warm start the model calls on nearly every problem (it cannot guess a product's first digit
    # yet); measured: after 100 steps of batch 32 at tool_share 0.5 it called on all 20 problems, half of them right.
    torch.manual_seed(0)
    tools = ToolsConfig(builtin=["calculator"], max_turns=2)
    folder = build_random_model(tmp_path, tied=False, tools=tools)
    data = PRODUCTS.model_copy(update={"arithmetic_num_train": 2000})
    stats = warm_start(folder, data, steps=100, lr=1e-3, batch=32, seed=0, tool_share=0.5, tools=tools)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = build_model_eval(folder)
    prompts, _ = load_arithmetic_prompts(data, "test", tokenizer)
    rollouts = greedy_tool_rollouts_hf(model, tokenizer, prompts, tools)
    assert tool_rollout_stats(prompts, rollouts)["call_rate"] >= 0.5
    assert stats["warm_start/loss_last"] < stats["warm_start/loss_first"] / 2
    called = [r for r in rollouts if r.calls]
    assert all(r.response_text.startswith("<tool_call>calculator:") for r in called)


def build_tokenizer_stub():
    class CharTokenizer:
        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [1] + [ord(c) for c in text]}

    return CharTokenizer()


def build_model_eval(folder: str):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_tool_demo_and_its_comparison_differ_only_in_the_tools():
    from pathlib import Path

    from protocols.config import load_config

    configs = Path(__file__).resolve().parents[1] / "deploy" / "configs"
    with_tools, without = load_config(configs / "demo_tools.yaml"), load_config(configs / "demo_tools_no_tools.yaml")
    assert with_tools.tools.names == ["calculator"] and not without.tools.enabled
    assert with_tools.data == without.data and with_tools.rollout == without.rollout
    assert with_tools.model == without.model and with_tools.train == without.train
    # Both start from one warm-started model.
    assert demo_model_key(with_tools.model.demo, with_tools.data, with_tools.tools) == \
        demo_model_key(without.model.demo, without.data, without.tools)
