"""Composes a verifier's task reward with the format reward and the length penalty of `reward.shaping`.

Runs inside the scorer's pool processes right after the verifier, so a slow user regex stays under the
per-sample timeout. `correct` is never changed here: it follows the task reward alone.
"""

import re
from functools import lru_cache

from protocols.reward import ShapingConfig
from protocols.trajectory import VerifierResult


@lru_cache(maxsize=16)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


def format_reward(response: str, pattern: str) -> float:
    """1.0 when `pattern` occurs in the response (re.search), else 0.0."""
    return 1.0 if _compiled(pattern).search(response) else 0.0


def length_fraction(num_tokens: int, start_tokens: int, window_tokens: int) -> float:
    """0 up to `start_tokens`, then rising linearly to 1 over `window_tokens`, then 1."""
    return min(1.0, max(0.0, (num_tokens - start_tokens) / window_tokens))


def compose(task: VerifierResult, response: str, num_tokens: int, cfg: ShapingConfig) -> VerifierResult:
    """reward = task_weight * task + format_weight * format - length_penalty_weight * length_fraction."""
    reward = cfg.task_weight * task.reward
    info = dict(task.info)
    info["task_reward"] = task.reward
    if cfg.format_weight > 0:
        fmt = format_reward(response, cfg.format_regex)
        info["format_reward"] = fmt
        reward += cfg.format_weight * fmt
    if cfg.length_penalty_weight > 0:
        penalty = cfg.length_penalty_weight * length_fraction(
            num_tokens, cfg.length_penalty_start_tokens, cfg.length_penalty_window_tokens
        )
        info["length_penalty"] = penalty
        reward -= penalty
    return VerifierResult(reward=reward, correct=task.correct, info=info, error=task.error)


def as_result(value: object, verifier_name: str) -> VerifierResult:
    """Accept what a verifier returned: a VerifierResult, or a bare number/bool taken as the task reward
    (correct when it is at least 1)."""
    if isinstance(value, VerifierResult):
        return value
    if isinstance(value, bool | int | float):
        reward = float(value)
        return VerifierResult(reward=reward, correct=reward >= 1.0)
    raise TypeError(
        f"verifier {verifier_name!r} returned {type(value).__name__}; a verifier returns a VerifierResult or a "
        "float reward (bool and int are accepted too)"
    )
