"""The long chain-of-thought demo task's problems: multiplication `a*b=` worked out as repeated addition.

The written-out solution of `a*b` has one step per unit of `b` (`k:s+a=t;`: counter, running sum, operand, new
sum), then `#` and the product, so its length grows with `b`; `b` is drawn from a mix of easy and long problems,
which gives the long tail of response lengths (docs/longcot_demo.md). Problems are generated, never read from
disk; each (a, b) pair belongs to the train or the test split by a fixed hash. rewards/datasets.py turns them into
`Prompt`s, demos/longcot_model.py warm-starts a model on the solutions, rewards/longcot.py scores the answers.
"""

import random
from typing import Literal

from rewards.arithmetic_data import _mix64

Split = Literal["train", "test"]

ANSWER_MARK = "#"
"""The final answer follows the last `#` of a response; the verifier reads nothing else."""

MIN_A, MAX_A = 10, 99
"""The repeated operand `a` is two-digit, so every step is a real addition with carries."""

EASY_MIN_B, EASY_MAX_B = 2, 14
"""Easy problems have `b` in [EASY_MIN_B, EASY_MAX_B]: about 20 to 200 response tokens."""

TEST_PER_MILLE = 250
"""One pair in four is held out (a larger share than the addition demo's one in ten, so the 200 held-out prompts
are distinct although easy pairs number only about 1,200)."""

_SPLIT_SALT = 0x10C0_7C07


def pair_split(a: int, b: int) -> Split:
    """The split of `a*b`: depends on the pair only (not on the seed or on any count)."""
    key = _mix64(((a & 0xFFFFFFFF) << 32 | (b & 0xFFFFFFFF)) ^ _SPLIT_SALT)
    return "test" if key % 1000 < TEST_PER_MILLE else "train"


def draw_b(rng: random.Random, long_fraction: float, max_b: int) -> int:
    """An easy `b` (uniform in [EASY_MIN_B, EASY_MAX_B]) or, with probability `long_fraction`, a long one (log-uniform in
    [EASY_MAX_B + 1, max_b]): the long ones are the tail."""
    if max_b <= EASY_MAX_B or rng.random() >= long_fraction:
        return rng.randint(EASY_MIN_B, min(EASY_MAX_B, max_b))
    low, high = EASY_MAX_B + 1, max_b
    # Log-uniform: as many problems between 13 and 26 steps as between 40 and 80.
    return min(high, int(low * (high / low) ** rng.random()))


def longcot_problems(
    split: Split, count: int, *, long_fraction: float, max_b: int, seed: int = 0, distinct: bool | None = None
) -> list[tuple[int, int]]:
    """`count` (a, b) pairs of `split` in a seeded order: a uniform in [MIN_A, MAX_A], b from `draw_b`.

    Test problems are distinct (a held-out score over repeats would weigh them twice); training problems may
    repeat, as the easy pairs are few and the mix, not the set, is what the warm start and RL should see.
    """
    distinct = split == "test" if distinct is None else distinct
    rng = random.Random(f"longcot/{split}/{seed}")
    chosen: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    tries = 0
    while len(chosen) < count:
        tries += 1
        if tries > 200 * count + 10_000:
            raise ValueError(
                f"cannot draw {count} distinct {split} problems with data.longcot_max_b={max_b}; "
                f"lower data.num_eval_prompts or raise data.longcot_max_b"
            )
        pair = (rng.randint(MIN_A, MAX_A), draw_b(rng, long_fraction, max_b))
        if pair_split(*pair) != split or (distinct and pair in seen):
            continue
        seen.add(pair)
        chosen.append(pair)
    return chosen


def problem_text(a: int, b: int) -> str:
    return f"{a}*{b}="


def solution_text(a: int, b: int) -> str:
    """The worked solution the warm start imitates: `k:s+a=t;` for k = 1..b (s the sum so far), then `#a*b`.

    e.g. 12*3 -> `1:0+12=12;2:12+12=24;3:24+12=36;#36`.
    """
    steps = [f"{k}:{(k - 1) * a}+{a}={k * a};" for k in range(1, b + 1)]
    return "".join(steps) + ANSWER_MARK + str(a * b)


def final_answer(response_text: str) -> str:
    """The text after the last answer mark, stripped; empty when there is none."""
    head, mark, tail = response_text.rpartition(ANSWER_MARK)
    return tail.strip() if mark else ""
