"""Where prompts come from and how they are turned into token ids (see rewards/datasets.py)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TaskSource(BaseModel):
    """One task of a task library in a mixture (`data.format: reasoning_gym`): its generator, its share of the
    training prompts, and the library's own scorer as its reward (rewards/task_library.py)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """The reasoning-gym dataset name, as `reasoning_gym.create_dataset` takes it (`basic_arithmetic`,
    `leg_counting`, `chain_sum`, ...). A name the installed library does not know is refused at start, with the
    names it knows."""

    label: str = ""
    """The task's name in metrics, plots and prompt ids (`source/<label>/*`); empty means `name`. Give two entries
    of one dataset with different configs different labels."""

    weight: float = Field(1.0, gt=0)
    """Share of the training prompts, relative to the other tasks' weights: the prompt cursor draws the tasks in
    these proportions at every point of the run (actors/prompt_cursor.py), whatever the tasks' sizes."""

    size: int = Field(1000, ge=1)
    """Distinct training entries generated; the task's prompts repeat, reshuffled, once it has used them all."""

    seed: int = Field(0, ge=0)
    """The generator's seed for the training entries. Held-out entries come from another seed far from it, and
    any that repeats a training question is left out and counted (`data/eval_overlap_skipped`)."""

    config: dict[str, Any] = Field(default_factory=dict)
    """The dataset's own settings (the fields of its reasoning-gym config class besides `size` and `seed`), e.g.
    `{min_terms: 2, max_terms: 3}` for `chain_sum`. The scorer builds the dataset with the same settings."""

    @property
    def source(self) -> str:
        """The task's name in metrics and in each prompt's `data_source`."""
        return self.label or self.name


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["arithmetic", "longcot", "gsm8k", "math", "jsonl", "parquet", "reasoning_gym"] = "arithmetic"
    """`arithmetic` is the built-in synthetic demo task; `longcot` the long chain-of-thought demo task
    (rewards/longcot_data.py: `a*b=` worked out step by step); `gsm8k` and `math` read those datasets' own fields;
    `jsonl` and `parquet` read any file through the field mapping below; `reasoning_gym` generates the mixture of
    `data.tasks` with reasoning-gym and scores each with the library's own `score_answer` (docs/tasks.md)."""

    tasks: list[TaskSource] = Field(default_factory=list)
    """`data.format: reasoning_gym`: the tasks of the mixture, each with its weight. Held-out evaluation is per task
    (`eval/<label>/accuracy`), with `data.num_eval_prompts` shared evenly between the tasks."""

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

    @model_validator(mode="after")
    def _check_tasks(self) -> "DataConfig":
        if self.format == "reasoning_gym" and not self.tasks:
            raise ValueError("data.format=reasoning_gym needs data.tasks: a list of reasoning-gym datasets, e.g. "
                             "`tasks: [{name: basic_arithmetic}, {name: leg_counting, weight: 2}]`")
        if self.tasks and self.format != "reasoning_gym":
            raise ValueError(f"data.tasks is set but data.format={self.format!r} does not read it; set "
                             "data.format=reasoning_gym, or remove data.tasks")
        labels = [t.source for t in self.tasks]
        repeated = sorted({label for label in labels if labels.count(label) > 1})
        if repeated:
            raise ValueError(f"data.tasks names {repeated} more than once: give each entry its own `label` (a "
                             "dataset may appear twice with different configs, under two labels)")
        for label in labels:
            if "/" in label or not label.strip():
                raise ValueError(f"data.tasks label {label!r} must be a non-empty name without `/`: it names the "
                                 "task's metrics (`source/<label>/accuracy`)")
        return self

    def source_weights(self) -> dict[str, float]:
        """{task label: weight} of a mixture, or {} when the data set is one source (the prompts are drawn in
        their shuffled order)."""
        return {t.source: t.weight for t in self.tasks}
