"""Where prompts come from and how they are turned into token ids (see rewards/datasets.py)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["arithmetic", "longcot", "gsm8k", "math", "jsonl", "parquet"] = "arithmetic"
    """`arithmetic` is the built-in synthetic demo task; `longcot` the long chain-of-thought demo task
    (rewards/longcot_data.py: `a*b=` worked out step by step); `gsm8k` and `math` read those datasets' own fields;
    `jsonl` and `parquet` read any file through the field mapping below."""

    train_path: str = ""
    """Training prompts file (JSONL or Parquet). Unused for `arithmetic`, which generates its prompts."""

    test_path: str = ""
    """Held-out prompts file for evaluation. Unused for `arithmetic`."""

    prompt_field: str = "question"
    """Row field holding the prompt text (for `jsonl`/`parquet`)."""

    answer_field: str = "answer"
    """Row field holding the gold answer."""

    tests_field: str = ""
    """Row field holding code test cases (a list of dicts, or that list as a JSON string); empty for
    answer-matching tasks. See rewards/README.md for the test-case keys."""

    prompt_template: str = "{prompt}"
    """Text sent as the user message; `{prompt}` is replaced by the row's prompt. Use it to ask for an answer
    format, e.g. `"{prompt}\nPut the final answer after ####."` (pair with reward.shaping.format_regex)."""

    system_prompt: str = ""
    """Optional system message placed before the prompt by the chat template."""

    use_chat_template: bool = True
    """Apply the tokenizer's chat template when it has one. The demo tokenizer has none and uses raw text."""

    max_prompt_tokens: int = Field(256, ge=1)
    """Prompts longer than this are skipped and counted in `data/skipped_too_long`, never truncated."""

    num_eval_prompts: int = Field(200, ge=1)
    """Held-out prompts scored (greedy) before and after training."""

    arithmetic_max_operand: int = Field(99, ge=1, le=9999)
    """Demo task: operands are drawn from [arithmetic_min_operand, this]."""

    arithmetic_min_operand: int = Field(0, ge=0, le=9999)
    """Demo task: smallest operand. The tool demo uses 100 (with max 9999: products of 3- to 4-digit numbers)."""

    arithmetic_op: Literal["+", "*"] = "+"
    """Demo task: `+` asks `a+b=` (the addition demo); `*` asks `a*b=`, a product the tiny model cannot work out
    in its head but can get from the calculator tool (deploy/configs/demo_tools.yaml)."""

    arithmetic_num_train: int = Field(5000, ge=1)
    """Demo task: distinct training problems generated (held-out problems never overlap them)."""

    longcot_num_train: int = Field(20_000, ge=1)
    """Long-CoT demo task: training problems generated (they may repeat; held-out ones never overlap them)."""

    longcot_long_fraction: float = Field(0.08, ge=0.0, le=1.0)
    """Long-CoT demo task: share of long problems (b log-uniform in [15, longcot_max_b]; the rest have b in
    [2, 14]). 0.08 gives a median response of 105 tokens and a 99th percentile of 886 (8.4x); 0 removes the tail."""

    longcot_max_b: int = Field(72, ge=2, le=500)
    """Long-CoT demo task: largest multiplier; the solution of `a*b` takes about 15 tokens per unit of b, so 72
    gives the longest response of 1,108 tokens. rollout.max_response_tokens and the model's context must cover it."""
