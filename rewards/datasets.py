"""Prompt loaders: read a split of a dataset (JSONL or Parquet), map its fields, apply the chat template,
tokenize, and skip prompts over `data.max_prompt_tokens`. The driver calls `load_prompts` once per split and
feeds the prompts to the rollout workers; the gold answer and tests ride along in each `Prompt`.
Imports data generators and answer formats only, never a verifier.
"""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from protocols.data import DataConfig
from protocols.trajectory import Prompt
from rewards.answer_formats import gsm8k_gold_answer, last_boxed
from rewards.arithmetic_data import arithmetic_problems, problem_answer, problem_text
from rewards.longcot_data import longcot_problems, solution_text
from rewards.longcot_data import problem_text as longcot_text
from rewards.task_library_data import load_task_prompts

Split = Literal["train", "test"]


class DataError(ValueError):
    """A row or file the loader cannot use; the message names the file and line."""


def load_prompts(cfg: DataConfig, split: Split, tokenizer: Any,
                 tools: list[dict] | None = None) -> tuple[list[Prompt], dict[str, int]]:
    """All usable prompts of `split` (at most `num_eval_prompts` for `test`) and counts: `data/loaded`,
    `data/skipped_too_long`. `tools`: OpenAI tool schemas the chat template writes into each prompt
    (ToolsConfig.template_tools)."""
    if cfg.format == "arithmetic":
        return load_arithmetic_prompts(cfg, split, tokenizer, tools=tools)
    if cfg.format == "longcot":
        return load_longcot_prompts(cfg, split, tokenizer, tools=tools)
    if cfg.format == "reasoning_gym":
        return load_task_prompts(cfg, split, tokenizer, encode_prompt, tools)
    setting = "data.train_path" if split == "train" else "data.test_path"
    path = cfg.train_path if split == "train" else cfg.test_path
    if not path:
        raise DataError(f"{setting} is empty but data.format={cfg.format!r} reads a file; set {setting} to a JSONL or Parquet file")
    if not Path(path).is_file():
        raise DataError(f"{setting}={path!r} does not exist or is not a file; give the path of a JSONL or Parquet file")
    dataset = cfg.format if cfg.format in ("gsm8k", "math") else Path(path).stem
    limit = cfg.num_eval_prompts if split == "test" else None
    prompts: list[Prompt] = []
    skipped = 0
    for where, index, row in _rows(path, cfg.format):
        text, answer, tests = _map_row(row, cfg, where)
        user_text = cfg.prompt_template.replace("{prompt}", text)
        ids = encode_prompt(user_text, cfg, tokenizer, tools)
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(
            Prompt(
                prompt_id=f"{dataset}/{split}/{index}",
                prompt_token_ids=ids,
                prompt_text=user_text,
                answer=answer,
                tests=tests,
                metadata={"source": where},
            )
        )
        if limit is not None and len(prompts) >= limit:
            break
    return prompts, {"data/loaded": len(prompts), "data/skipped_too_long": skipped}


def load_arithmetic_prompts(
    cfg: DataConfig, split: Split, tokenizer: Any, seed: int = 0, tools: list[dict] | None = None
) -> tuple[list[Prompt], dict[str, int]]:
    """Prompts of one split (`arithmetic_num_train` for train, `num_eval_prompts` for test) and loader counts.

    The problems come from rewards/arithmetic_data.py. The text `a+b=` (or `a*b=`) goes through
    `data.prompt_template` and the chat template like any dataset's (both are no-ops for the demo tokenizer with
    default settings, which then only puts BOS in front). Prompts longer than `cfg.max_prompt_tokens` are skipped,
    never truncated, and counted.
    """
    count = cfg.arithmetic_num_train if split == "train" else cfg.num_eval_prompts
    prompts: list[Prompt] = []
    skipped = 0
    pairs = arithmetic_problems(cfg.arithmetic_max_operand, split, count, seed, min_operand=cfg.arithmetic_min_operand)
    for i, (a, b) in enumerate(pairs):
        text = cfg.prompt_template.replace("{prompt}", problem_text(a, b, cfg.arithmetic_op))
        ids = encode_prompt(text, cfg, tokenizer, tools)
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(
            Prompt(
                prompt_id=f"arithmetic/{split}/{i}",
                prompt_token_ids=ids,
                prompt_text=text,
                answer=problem_answer(a, b, cfg.arithmetic_op),
            )
        )
    return prompts, {"data/loaded": len(prompts), "data/skipped_too_long": skipped}


def load_longcot_prompts(
    cfg: DataConfig, split: Split, tokenizer: Any, seed: int = 0, tools: list[dict] | None = None
) -> tuple[list[Prompt], dict[str, int]]:
    """The long-CoT demo task's prompts `a*b=` (rewards/longcot_data.py; `longcot_num_train` for train,
    `num_eval_prompts` distinct ones for test), gold answer `str(a*b)`, `a` and `b` in the metadata, and
    `length_hint`: the written-out solution's tokens (one per character) plus EOS, a function of the prompt's `a`
    and `b` alone, which length-aware dispatch reads (rollout.length_aware_dispatch, actors/length_history.py)."""
    count = cfg.longcot_num_train if split == "train" else cfg.num_eval_prompts
    pairs = longcot_problems(split, count, long_fraction=cfg.longcot_long_fraction, max_b=cfg.longcot_max_b, seed=seed)
    prompts: list[Prompt] = []
    skipped = 0
    for i, (a, b) in enumerate(pairs):
        text = cfg.prompt_template.replace("{prompt}", longcot_text(a, b))
        ids = encode_prompt(text, cfg, tokenizer, tools)
        if len(ids) > cfg.max_prompt_tokens:
            skipped += 1
            continue
        prompts.append(Prompt(prompt_id=f"longcot/{split}/{i}", prompt_token_ids=ids, prompt_text=text,
                              answer=str(a * b),
                              metadata={"a": a, "b": b, "length_hint": len(solution_text(a, b)) + 1}))
    return prompts, {"data/loaded": len(prompts), "data/skipped_too_long": skipped}


def encode_prompt(user_text: str, cfg: DataConfig, tokenizer: Any, tools: list[dict] | None = None) -> list[int]:
    """Token ids of the prompt: through the chat template when enabled and the tokenizer has one (the template
    already holds the special tokens, so none are added again; `tools` are its tool schemas), else the raw text
    with the tokenizer's own special tokens (BOS)."""
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        messages.append({"role": "user", "content": user_text})
        text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = f"{cfg.system_prompt}\n\n{user_text}" if cfg.system_prompt else user_text
    return list(tokenizer(text)["input_ids"])


def _rows(path: str, fmt: str) -> Iterator[tuple[str, int, dict]]:
    """(`file:line`, row index, row) for each row; JSONL unless the file ends in .parquet (or fmt is parquet)."""
    if fmt == "parquet" or path.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for index, row in enumerate(table.to_pylist()):
            yield f"{path}:row {index + 1}", index, row
        return
    index = 0
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); fix or remove the line") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            yield where, index, row
            index += 1


def _field(row: dict, name: str, setting: str, where: str) -> Any:
    if name not in row:
        raise DataError(
            f"{where}: row has no field {name!r} ({setting}={name!r}); its fields are {sorted(row)}. "
            f"Set {setting} to the right field name."
        )
    return row[name]


def _map_row(row: dict, cfg: DataConfig, where: str) -> tuple[str, str, list[dict]]:
    """(prompt text, gold answer, tests) of one row, by the dataset's own fields or the configured mapping."""
    if cfg.format == "gsm8k":
        # The dataset's `answer` is a worked solution ending in `#### <number>`.
        solution = str(_field(row, "answer", "data.format=gsm8k reads", where))
        if "####" not in solution:
            raise DataError(f"{where}: GSM8K answer has no `#### <number>` line; is data.format right?")
        return str(_field(row, "question", "data.format=gsm8k reads", where)), gsm8k_gold_answer(solution), []
    if cfg.format == "math":
        problem = str(_field(row, "problem", "data.format=math reads", where))
        if row.get("answer") not in (None, ""):
            return problem, str(row["answer"]), []
        boxed = last_boxed(str(_field(row, "solution", "data.format=math reads", where)))
        if boxed is None:
            raise DataError(f"{where}: MATH row has no `answer` field and its `solution` has no \\boxed{{}} answer")
        return problem, boxed, []
    text = str(_field(row, cfg.prompt_field, "data.prompt_field", where))
    if cfg.tests_field:
        # Code tasks are scored by their tests; a gold answer is optional.
        answer = str(row.get(cfg.answer_field, "")) if cfg.answer_field else ""
    else:
        answer = str(_field(row, cfg.answer_field, "data.answer_field", where))
    tests: list[dict] = []
    if cfg.tests_field:
        tests = _field(row, cfg.tests_field, "data.tests_field", where)
        if isinstance(tests, str):
            try:
                tests = json.loads(tests)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: field {cfg.tests_field!r} is a string but not JSON ({err.msg})") from None
        if not isinstance(tests, list) or not all(isinstance(t, dict) for t in tests):
            raise DataError(f"{where}: field {cfg.tests_field!r} must be a list of test-case objects, got {type(tests).__name__}")
    return text, answer, tests
