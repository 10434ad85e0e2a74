"""The `reasoning_gym` verifier: a task library's own scorer as the reward.

The answer is what the response puts in its last `<answer>...</answer>` tags (reasoning-gym's `extract_answer`,
the format its system prompts ask for), and the reward is the prompt's dataset's `score_answer(answer, entry)`,
with the dataset built from the settings the prompt carries (rewards/task_library_data.py). It runs in the reward
workers' scorer processes, under their time bounds: a scorer that raises or hangs is an error counted on that
sample. `correct` is a full score (1.0).
"""

import json
from functools import lru_cache
from typing import Any

from protocols.trajectory import Prompt, VerifierResult
from rewards.spec import VerifierSpec
from rewards.task_library_data import VERIFIER, import_reasoning_gym

MAX_ANSWER_CHARS = 10_000
"""An answer longer than this is not scored (reward 0, `info.answer_too_long`): no task's answer is that long,
and some scorers compare strings in quadratic time."""


@lru_cache(maxsize=256)
def _dataset(name: str, config_json: str, size: int, seed: int) -> Any:
    # built once per task in each scorer process: some generators precompute tables at construction
    reasoning_gym = import_reasoning_gym()
    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config_json))


def task_dataset(key: dict[str, Any]) -> Any:
    """The dataset a prompt's `task` key names (name, config, size, seed)."""
    return _dataset(key["name"], json.dumps(key["config"], sort_keys=True), key["size"], key["seed"])


def extract_answer(response_text: str) -> str | None:
    """The text in the response's last `<answer>` tags, stripped; None when there are none."""
    from reasoning_gym.utils import extract_answer as library_extract

    return library_extract(response_text)


def verify_task(prompt: Prompt, response_text: str) -> VerifierResult:
    """reward = score_answer(extract_answer(response), entry) of the prompt's own dataset."""
    key, entry = prompt.metadata.get("task"), prompt.metadata.get("entry")
    if key is None or entry is None:
        raise ValueError(f"prompt {prompt.prompt_id!r} names verifier {VERIFIER!r} but carries no reasoning-gym task "
                         "and entry (metadata.task, metadata.entry): such prompts come from data.format=reasoning_gym")
    answer = extract_answer(response_text)
    info: dict[str, Any] = {"answer": answer, "source": prompt.metadata.get("data_source", key["name"])}
    if answer is not None and len(answer) > MAX_ANSWER_CHARS:
        return VerifierResult(reward=0.0, info={**info, "answer": answer[:100], "answer_too_long": True})
    score = float(task_dataset(key).score_answer(answer, entry))
    return VerifierResult(reward=score, correct=score >= 1.0, info=info)


SPEC = VerifierSpec(name=VERIFIER, fn=verify_task)
