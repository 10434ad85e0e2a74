"""Prompt loaders: real GSM8K rows, the field mapping for JSONL and Parquet, MATH gold answers, the chat
template, malformed rows named by file:line, and too-long prompts skipped and counted."""

import json
import os
from pathlib import Path

import pytest

from protocols.data import DataConfig
from rewards.datasets import DataError, load_prompts


def gsm8k_dir() -> Path:
    shared = os.environ.get("RELAYRL_SHARED_DIR")
    return (Path(shared) if shared else Path(__file__).resolve().parents[2] / "shared") / "data/gsm8k"


@pytest.fixture(scope="module")
def char_tokenizer():
    """One token per character, BOS added to raw text, and a tiny chat template; built locally."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<bos>{{ m.role }}:{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
    )
    return fast


def _write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_gsm8k_real_rows(char_tokenizer):
    path = gsm8k_dir() / "test.jsonl"
    assert path.is_file(), f"{path} not found: GSM8K lives in ../shared/data/gsm8k, or set RELAYRL_SHARED_DIR"
    cfg = DataConfig(format="gsm8k", test_path=str(path), max_prompt_tokens=4096, num_eval_prompts=20, use_chat_template=False)
    prompts, counts = load_prompts(cfg, "test", char_tokenizer)
    assert counts == {"data/loaded": 20, "data/skipped_too_long": 0}
    first = prompts[0]
    # row 0 is Janet's ducks; its answer ends in "#### 18"
    assert first.prompt_id == "gsm8k/test/0"
    assert first.prompt_text.startswith("Janet")
    assert first.answer == "18"
    # raw text: BOS then one id per character
    assert first.prompt_token_ids[0] == 1
    assert len(first.prompt_token_ids) == 1 + len(first.prompt_text)


def test_chat_template_and_system_prompt_without_double_bos(char_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [{"q": "2+2?", "a": "4"}])
    cfg = DataConfig(format="jsonl", train_path=path, prompt_field="q", answer_field="a",
                     system_prompt="Be brief.", prompt_template="{prompt} Answer after ####.")
    (prompt,), _ = load_prompts(cfg, "train", char_tokenizer)
    chars = char_tokenizer.convert_tokens_to_ids
    # <bos>system:...\n <bos>user:...\n <bos>assistant: -- the template's own <bos> (id 1) three times, none added
    expected = [1] + chars(list("system:Be brief.\n")) + [1] + chars(list("user:2+2? Answer after ####.\n"))
    expected += [1] + chars(list("assistant:"))
    assert prompt.prompt_token_ids == expected
    assert prompt.prompt_text == "2+2? Answer after ####."
    assert prompt.answer == "4"


def test_malformed_json_line_is_named_with_file_and_line(char_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1"}, "", '{"question": "b", "answer": '])
    cfg = DataConfig(format="jsonl", train_path=path)
    # line 1 is fine, line 2 blank (skipped), line 3 cut short
    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON"):
        load_prompts(cfg, "train", char_tokenizer)


def test_missing_field_names_the_setting_and_line(char_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    cfg = DataConfig(format="jsonl", train_path=path)
    with pytest.raises(DataError, match=rf"{path}:2: row has no field 'question' \(data.prompt_field='question'\)"):
        load_prompts(cfg, "train", char_tokenizer)


def test_too_long_prompt_is_skipped_and_counted(char_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"question": "abc", "answer": "1"}, {"question": "x" * 50, "answer": "2"}])
    # raw text with BOS: "abc" -> 4 tokens (kept), 50 x's -> 51 tokens (over 10, skipped)
    cfg = DataConfig(format="jsonl", train_path=path, max_prompt_tokens=10, use_chat_template=False)
    prompts, counts = load_prompts(cfg, "train", char_tokenizer)
    assert [p.answer for p in prompts] == ["1"]
    assert prompts[0].prompt_token_ids == char_tokenizer("abc")["input_ids"]
    assert counts["data/skipped_too_long"] == 1


def test_math_gold_from_answer_field_or_last_boxed(char_tokenizer, tmp_path):
    rows = [{"problem": "p1", "solution": r"so \boxed{\frac{1}{2}}"}, {"problem": "p2", "solution": "...", "answer": "7"}]
    cfg = DataConfig(format="math", train_path=_write_jsonl(tmp_path / "math.jsonl", rows), use_chat_template=False)
    prompts, _ = load_prompts(cfg, "train", char_tokenizer)
    assert [p.answer for p in prompts] == [r"\frac{1}{2}", "7"]
    assert prompts[1].prompt_id == "math/train/1"


def test_parquet_with_tests_field(char_tokenizer, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tests = [{"input": "1\n", "output": "2\n"}]
    path = tmp_path / "code.parquet"
    pq.write_table(pa.table({"prompt": ["double it"], "tests": [json.dumps(tests)]}), path)
    cfg = DataConfig(format="parquet", train_path=str(path), prompt_field="prompt", tests_field="tests", use_chat_template=False)
    (prompt,), _ = load_prompts(cfg, "train", char_tokenizer)
    assert prompt.tests == tests and prompt.answer == ""
    assert prompt.prompt_id == "code/train/0"


def test_missing_path_names_the_setting(char_tokenizer):
    with pytest.raises(DataError, match="data.test_path is empty"):
        load_prompts(DataConfig(format="gsm8k"), "test", char_tokenizer)
