"""GSM8K verifier: the number after the last `####` in the response, else its last number, compared with
the gold number (the one after `#### ` in the dataset's `answer` field) as exact rationals.
"""

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from protocols.trajectory import Prompt, VerifierResult
from rewards.registry import register_verifier

# A number: optional sign and `$`, digits with thousands commas only in groups of three (so "1,2,3" is three
# numbers, not 123), an optional decimal part. A trailing sentence period is not followed by a digit, so it
# never joins the number.
_NUMBER = re.compile(r"(?<![\w.])-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")
_MARKER = "####"


def parse_number(text: str) -> Fraction | None:
    """`"$1,234.50"` -> Fraction(2469, 2); None when `text` is not a number."""
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(Decimal(cleaned))
    except (InvalidOperation, ValueError):
        return None


def extract_answer(response: str) -> tuple[str | None, str]:
    """The answer text and where it came from: (`"18"`, `"marker"`), (`"18"`, `"last_number"`) or (None, "")."""
    if _MARKER in response:
        after = response.rsplit(_MARKER, 1)[1]
        match = _NUMBER.search(after)
        if match:
            return match.group(0).strip(), "marker"
    matches = _NUMBER.findall(response)
    if matches:
        return matches[-1].strip(), "last_number"
    return None, ""


def gold_answer(answer_field: str) -> str:
    """The dataset's `answer` holds a worked solution ending in `#### 18`; a bare `18` is accepted as is."""
    if _MARKER in answer_field:
        return answer_field.rsplit(_MARKER, 1)[1].strip()
    return answer_field.strip()


@register_verifier("gsm8k")
def verify_gsm8k(prompt: Prompt, response: str) -> VerifierResult:
    gold_text = gold_answer(prompt.answer)
    gold = parse_number(gold_text)
    if gold is None:
        raise ValueError(
            f"prompt {prompt.prompt_id}: gold answer {gold_text!r} is not a number; GSM8K gold answers follow "
            "`#### ` in the dataset's answer field (check data.answer_field)"
        )
    extracted, source = extract_answer(response)
    value = parse_number(extracted) if extracted is not None else None
    correct = value is not None and value == gold
    return VerifierResult(
        reward=1.0 if correct else 0.0,
        correct=correct,
        info={"extracted": extracted, "gold": gold_text, "source": source},
    )
