"""GSM8K verifier: answer extraction by hand, and the dataset's own solutions on every test row."""

import json
import os
import time
from pathlib import Path


import pytest

from protocols.reward import Gsm8kConfig
from protocols.trajectory import Prompt
from rewards import gsm8k
from rewards.gsm8k import MAX_NUMBER_CHARS, MAX_RESPONSE_CHARS, extract_answer, gold_answer, parse_number, verify_gsm8k


def gsm8k_dir() -> Path:
    shared = os.environ.get("RELAYRL_SHARED_DIR")
    return (Path(shared) if shared else Path(__file__).resolve().parents[2] / "shared") / "data/gsm8k"


def _prompt(answer: str) -> Prompt:
    return Prompt(prompt_id="gsm8k/test/0", prompt_token_ids=[0], answer=answer)


def test_marker_wins_over_later_numbers():
    # "#### 18" is the answer even though 2024 is the last number in the text
    assert extract_answer("9 * 2 = 18\n#### 18\nchecked in 2024") == ("18", "marker")


def test_last_number_with_dollar_comma_and_period():
    # "$1,234.50." -> strip "$", "," and the sentence period -> 1234.50 = 2469/2
    text, source = extract_answer("She pays $1,234.50.")
    assert source == "last_number"
    assert parse_number(text) * 2 == 2469


def test_commas_only_group_thousands():
    # "1,2,3" is a list, so the last number is 3, not 123
    assert extract_answer("the values 1,2,3")[0] == "3"


def test_negative_and_decimal_equal_integer_gold():
    # 18.00 == 18 and -5 == -5
    assert verify_gsm8k(_prompt("#### 18"), "so 18.00 dollars").correct
    assert verify_gsm8k(_prompt("-5"), "the change is -5.").correct


def test_wrong_or_missing_number_scores_zero():
    assert verify_gsm8k(_prompt("18"), "the answer is 17").reward == 0.0
    result = verify_gsm8k(_prompt("18"), "I do not know")
    assert result.reward == 0.0 and result.info["extracted"] is None


def test_info_carries_extracted_and_gold():
    result = verify_gsm8k(_prompt("Janet ... #### 18"), "#### 18")
    assert result.info == {"extracted": "18", "gold": "18", "source": "marker"}


def _verify(gold: str, response: str, mode: str) -> float:
    gsm8k.configure(Gsm8kConfig(mode=mode))
    try:
        return verify_gsm8k(_prompt(gold), response).reward
    finally:
        gsm8k.configure(Gsm8kConfig())


def test_default_mode_is_flexible():
    # the shipped default keeps prompts that do not ask for "####" scoreable: "so 18.00 dollars" reads 18
    assert Gsm8kConfig().mode == "flexible"
    assert extract_answer("so 18.00 dollars") == ("18.00", "last_number")


@pytest.mark.parametrize(
    ("gold", "response", "strict", "flexible"),
    [
        # the number right after the last "####": both modes
        ("18", "9 * 2 = 18\n#### 18", 1.0, 1.0),
        ("18", "#### $18.", 1.0, 1.0),
        # no marker: strict scores 0 (verl's default), flexible takes the last number
        ("18", "so she makes 18 dollars", 0.0, 1.0),
        # marker followed by words, then the number: not "right after" for strict; flexible finds it
        ("18", "#### The answer is 18", 0.0, 1.0),
        # a marker with the wrong number: 0 in both, even if the right one appears earlier
        ("18", "18 is close, but #### 17", 0.0, 0.0),
    ],
)
def test_strict_and_flexible_modes(gold, response, strict, flexible):
    assert _verify(gold, response, "strict") == strict
    assert _verify(gold, response, "flexible") == flexible


@pytest.mark.parametrize("mode", ["strict", "flexible"])
def test_subtraction_is_not_a_negative_number(mode):
    # "10 - 5" is 10 minus 5: the last number is 5, never -5 (flexible); the same after the marker for both
    assert extract_answer("She has 10 - 5", "flexible")[0] == "5"
    assert extract_answer("(7) - 2 = 5", "flexible")[0] == "5"
    assert _verify("5", "She has 10 - 5", "flexible") == 1.0
    assert _verify("-5", "She has 10 - 5", "flexible") == 0.0
    # a minus after a word or "=" is a sign: "is -5" and "x = -5" are -5
    assert extract_answer("the change is -5", "flexible")[0] == "-5"
    assert _verify("-5", "x = -5\n#### -5", mode) == 1.0


@pytest.mark.parametrize("mode", ["strict", "flexible"])
def test_unicode_minus_is_minus_for_answer_and_gold(mode):
    # U+2212 "−5" is -5: it matches the gold -5 written either way, and never the gold 5
    assert _verify("5", "#### \u22125", mode) == 0.0
    assert _verify("-5", "#### \u22125", mode) == 1.0
    assert _verify("\u22125", "#### -5", mode) == 1.0
    assert _verify("#### \u22125", "#### \u22125", mode) == 1.0
    assert parse_number("\u22125") == -5
    # an en dash used as minus reads the same way
    assert _verify("-5", "#### \u20135", mode) == 1.0


def test_a_5000_digit_answer_is_refused_not_converted():
    # int("1" * 5000) would raise ValueError (Python's 4300-digit limit); the number is over MAX_NUMBER_CHARS = 100
    result = verify_gsm8k(_prompt("#### 18"), "#### " + "1" * 5000)
    assert (result.reward, result.info["reason"]) == (0.0, "number_too_long")
    assert result.info["extracted"] == "1" * MAX_NUMBER_CHARS + "..."


@pytest.mark.parametrize("text", ["1" * 101, "1e999999999", "1E-1000", "inf", "-Infinity", "nan"])
def test_parse_number_refuses_what_it_cannot_read_cheaply(text):
    # 101 characters, exponents of 10^9 and -1000 (over 100), and the non-finite values: None, never an exception
    assert parse_number(text) is None


def test_parse_number_reads_up_to_100_characters():
    assert parse_number("9" * 100) == 10**100 - 1


@pytest.mark.parametrize("mode", ["strict", "flexible"])
def test_a_megabyte_response_is_read_from_its_end_quickly(mode):
    # 500,000 numbers, then the answer: only the last MAX_RESPONSE_CHARS = 100,000 characters are read
    response = "1 " * 500_000 + "#### 18"
    start = time.perf_counter()
    assert extract_answer(response, mode) == ("18", "marker")
    assert time.perf_counter() - start < 1.0
    assert len(response) > 10 * MAX_RESPONSE_CHARS


def test_telling_signs_from_subtraction_stays_linear():
    # "1 - 1 - 1 ...": 25,000 minus signs in 100,000 characters, each after a 1, so each is subtraction; the
    # check looks back over the spaces before a sign only, not the whole text before it
    start = time.perf_counter()
    assert extract_answer("1 " + "- 1 " * 25_000, "flexible") == ("1", "last_number")
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("mode", ["strict", "flexible"])
def test_every_test_row_solution_scores_one_in_both_modes(mode):
    # the dataset's own solutions end in "#### N", so strict mode accepts them all too
    path = gsm8k_dir() / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert sum(_verify(r["answer"], r["answer"], mode) for r in rows) == 1319


def test_every_test_row_solution_scores_one_and_other_answers_zero():
    path = gsm8k_dir() / "test.jsonl"
    assert path.is_file(), f"{path} not found: GSM8K lives in ../shared/data/gsm8k, or set RELAYRL_SHARED_DIR"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    golds = [parse_number(gold_answer(r["answer"])) for r in rows]
    mismatched = 0
    for i, row in enumerate(rows):
        prompt = _prompt(row["answer"])
        assert verify_gsm8k(prompt, row["answer"]).reward == 1.0, i
        # Pair with the next row whose gold differs: its solution must score 0 here.
        j = next(k % len(rows) for k in range(i + 1, i + len(rows)) if golds[k % len(rows)] != golds[i])
        assert verify_gsm8k(prompt, rows[j]["answer"]).reward == 0.0, (i, j)
        mismatched += 1
    assert mismatched == 1319
