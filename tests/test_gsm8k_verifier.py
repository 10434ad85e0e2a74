"""GSM8K verifier: answer extraction by hand, and the dataset's own solutions on every test row."""

import json
import os
from pathlib import Path


from protocols.trajectory import Prompt
from rewards.gsm8k import extract_answer, gold_answer, parse_number, verify_gsm8k


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
