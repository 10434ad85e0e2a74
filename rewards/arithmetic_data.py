"""The built-in demo task's problems: addition `a+b=` whose gold answer is `str(a+b)`, or products `a*b=` (the
tool demo, where the model calls the calculator) whose gold answer is `str(a*b)`.

Problems are generated, never read from disk: each (a, b) pair belongs to the train or the test split by a fixed
hash, so the splits never overlap whatever the counts or the seed. rewards/datasets.py turns them into `Prompt`s;
rewards/arithmetic.py scores the responses.
"""

import random
from typing import Literal

Split = Literal["train", "test"]

TEST_FRACTION_PER_MILLE = 100
"""One pair in ten is held out. Fixed, so a warm-started model never saw any test pair."""

_SPLIT_SALT = 0x5EED_A11D
_ENUMERATE_LIMIT = 1_000_000
"""Operand spaces up to this many pairs are enumerated exactly; larger ones are sampled."""


def _mix64(x: int) -> int:
    # splitmix64 finalizer: a cheap, well-spread, platform-independent hash (Python's hash() is salted per process).
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def pair_split(a: int, b: int) -> Split:
    """The split a pair belongs to: depends on the pair only (not on the seed or on any count)."""
    key = _mix64(((a & 0xFFFFFFFF) << 32 | (b & 0xFFFFFFFF)) ^ _SPLIT_SALT)
    return "test" if key % 1000 < TEST_FRACTION_PER_MILLE else "train"


def arithmetic_problems(
    max_operand: int, split: Split, count: int, seed: int = 0, min_operand: int = 0
) -> list[tuple[int, int]]:
    """`count` distinct (a, b) pairs of `split`, operands in [min_operand, max_operand], in a seeded order.

    The order (and, for large operand spaces, which pairs are drawn) depends on `seed`; split membership does not.
    """
    if min_operand > max_operand:
        raise ValueError(
            f"data.arithmetic_min_operand={min_operand} is above data.arithmetic_max_operand={max_operand}: operands "
            f"are drawn from [min, max]. Lower the minimum or raise the maximum.")
    space = (max_operand - min_operand + 1) ** 2
    expected_pool = space * (TEST_FRACTION_PER_MILLE if split == "test" else 1000 - TEST_FRACTION_PER_MILLE) // 1000
    setting = "data.num_eval_prompts" if split == "test" else "data.arithmetic_num_train"
    if space <= _ENUMERATE_LIMIT:
        operands = range(min_operand, max_operand + 1)
        pairs = [(a, b) for a in operands for b in operands if pair_split(a, b) == split]
        if count > len(pairs):
            raise ValueError(
                f"{setting}={count} asks for more {split} problems than exist with "
                f"data.arithmetic_min_operand={min_operand} and data.arithmetic_max_operand={max_operand}: "
                f"the {split} split has {len(pairs)} pairs. "
                f"Lower {setting} to at most {len(pairs)} or raise data.arithmetic_max_operand."
            )
        pairs.sort(key=lambda p: _mix64((p[0] * (max_operand + 1) + p[1]) ^ _mix64(seed)))
        return pairs[:count]
    if count > expected_pool // 2:
        # Rejection sampling of distinct pairs slows down sharply past half the pool.
        raise ValueError(
            f"{setting}={count} is more than half of the about {expected_pool} {split} pairs with "
            f"data.arithmetic_min_operand={min_operand} and data.arithmetic_max_operand={max_operand}; lower "
            f"{setting} or widen the operand range."
        )
    rng = random.Random(f"arithmetic/{split}/{seed}")
    chosen: dict[tuple[int, int], None] = {}
    while len(chosen) < count:
        pair = (rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand))
        if pair_split(*pair) == split:
            chosen[pair] = None
    return list(chosen)


def problem_text(a: int, b: int, op: str = "+") -> str:
    return f"{a}{op}{b}="


def problem_answer(a: int, b: int, op: str = "+") -> str:
    """The gold answer: the sum or the product, as decimal digits."""
    if op == "+":
        return str(a + b)
    if op == "*":
        return str(a * b)
    raise ValueError(f"data.arithmetic_op={op!r} is not an arithmetic task's operator; use '+' or '*'")
