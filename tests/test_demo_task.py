"""The arithmetic demo task: split generation, the exact-match verifier and the prompt loader."""

import pytest

from protocols.data import DataConfig
from protocols.trajectory import Prompt
from rewards.arithmetic import verify_arithmetic
from rewards.arithmetic_data import arithmetic_problems, pair_split, problem_text
from rewards.datasets import load_arithmetic_prompts
from rewards.registry import resolve_verifier


class CharTokenizer:
    """Stand-in for the demo tokenizer: BOS (id 1) then one id per character, so `a+b=` costs len(text) + 1."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [1] + [3 + "0123456789+=".index(ch) for ch in text]}


def _prompt(answer: str) -> Prompt:
    return Prompt(prompt_id="arithmetic/test/0", prompt_token_ids=[1], prompt_text="20+37=", answer=answer)


def test_train_and_test_splits_never_share_a_pair():
    # Operands 0..99 give 10,000 pairs; one in ten is held out, so 5,000 train and 500 test both fit.
    train = arithmetic_problems(99, "train", 5000)
    test = arithmetic_problems(99, "test", 500)
    assert len(set(train)) == 5000 and len(set(test)) == 500
    assert not set(train) & set(test)


def test_split_membership_does_not_depend_on_seed_or_count():
    # The seed only reorders: a pair in seed 0's test split is in the test pool of every seed.
    test_seed0 = set(arithmetic_problems(99, "test", 300, seed=0))
    test_seed7 = set(arithmetic_problems(99, "test", 300, seed=7))
    assert all(pair_split(a, b) == "test" for a, b in test_seed0 | test_seed7)
    assert arithmetic_problems(99, "train", 10, seed=3) == arithmetic_problems(99, "train", 100, seed=3)[:10]


def test_about_one_pair_in_ten_is_held_out():
    # 10,000 pairs with a 10% test bucket: expect about 1,000 (binomial sd 30), so [900, 1100] is safe.
    held_out = sum(pair_split(a, b) == "test" for a in range(100) for b in range(100))
    assert 900 <= held_out <= 1100


def test_generation_is_deterministic():
    assert arithmetic_problems(99, "test", 50, seed=1) == arithmetic_problems(99, "test", 50, seed=1)


def test_large_operand_space_is_sampled_disjointly():
    # 10,000^2 pairs: too many to enumerate, drawn by rejection sampling instead.
    train = arithmetic_problems(9999, "train", 2000)
    test = arithmetic_problems(9999, "test", 200)
    assert len(set(train)) == 2000 and len(set(test)) == 200
    assert not set(train) & set(test)
    assert all(0 <= a <= 9999 and 0 <= b <= 9999 for a, b in train + test)


def test_asking_for_more_problems_than_the_split_holds_names_the_setting():
    # Operands 0..3 give 16 pairs, so 100 training problems cannot exist.
    with pytest.raises(ValueError, match="data.arithmetic_num_train=100"):
        arithmetic_problems(3, "train", 100)


def test_problem_text():
    assert problem_text(20, 37) == "20+37="


@pytest.mark.parametrize(
    ("response", "correct"),
    [
        ("57", True),
        ("57 ", True),  # surrounding whitespace is stripped
        ("\n57", True),
        ("5", False),  # a prefix of the answer is wrong
        ("577", False),
        ("", False),
        ("057", False),  # exact text match, not numeric equality
        ("5 7", False),
    ],
)
def test_verifier_exact_match(response: str, correct: bool):
    result = verify_arithmetic(_prompt("57"), response)
    assert result.correct is correct
    assert result.reward == (1.0 if correct else 0.0)
    assert result.info["extracted"] == response.strip()


def test_verifier_is_registered_as_arithmetic():
    spec = resolve_verifier("arithmetic")
    assert spec.fn is verify_arithmetic and not spec.batched


def test_loader_builds_prompts_with_bos_and_gold_answer():
    cfg = DataConfig(num_eval_prompts=20)
    prompts, counts = load_arithmetic_prompts(cfg, "test", CharTokenizer())
    assert counts == {"data/loaded": 20, "data/skipped_too_long": 0}
    assert len(prompts) == 20
    first = prompts[0]
    assert first.prompt_id == "arithmetic/test/0"
    a, b = (int(x) for x in first.prompt_text.rstrip("=").split("+"))
    assert first.answer == str(a + b)
    # "a+b=" has len(text) characters; the tokenizer puts BOS (1) in front.
    assert first.prompt_token_ids[0] == 1 and len(first.prompt_token_ids) == len(first.prompt_text) + 1
    assert all(pair_split(*(int(x) for x in p.prompt_text.rstrip("=").split("+"))) == "test" for p in prompts)


def test_loader_train_split_uses_num_train():
    cfg = DataConfig(arithmetic_num_train=30)
    prompts, _ = load_arithmetic_prompts(cfg, "train", CharTokenizer())
    assert len(prompts) == 30
    assert [p.prompt_id for p in prompts[:2]] == ["arithmetic/train/0", "arithmetic/train/1"]


def test_loader_skips_and_counts_long_prompts():
    # With BOS, "a+b=" costs 5 tokens (one-digit a and b) up to 7 (two digits each). A limit of 6 keeps only
    # prompts with at least one one-digit operand; every prompt is either kept or counted.
    cfg = DataConfig(num_eval_prompts=200, max_prompt_tokens=6)
    prompts, counts = load_arithmetic_prompts(cfg, "test", CharTokenizer())
    assert all(len(p.prompt_token_ids) <= 6 for p in prompts)
    assert len(prompts) == counts["data/loaded"]
    assert counts["data/loaded"] + counts["data/skipped_too_long"] == 200
    assert counts["data/skipped_too_long"] > 0
