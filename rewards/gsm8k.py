"""GSM8K verifier: the answer number taken from the response (`strict`: only the number right after the last
`####`, as verl's default; `flexible`: that, else the response's last number) compared with the gold number
(the one after `#### ` in the dataset's `answer` field) as exact rationals.
"""

import re
from collections import deque
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from protocols.reward import Gsm8kConfig, RewardConfig
from protocols.trajectory import Prompt, VerifierResult
from rewards.answer_formats import GSM8K_MARKER
from rewards.answer_formats import gsm8k_gold_answer as gold_answer
from rewards.spec import VerifierSpec

# Unicode minus signs and dashes written as minus ("−5", "–5") read as "-", in responses and gold alike, so
# "#### −5" is -5 (never 5) on both sides.
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-", "\u2012": "-", "\ufe63": "-", "\uff0d": "-"})
# A number: an optional sign and `$`, digits with thousands commas only in groups of three (so "1,2,3" is three
# numbers, not 123), an optional decimal part. A trailing sentence period is not followed by a digit, so it
# never joins the number. Group 1 is the sign, group 2 the number.
_NUMBER = re.compile(r"(?<![\w.])(-?)(\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")
# What a minus after a digit or one of these (whitespace between) is: subtraction ("10 - 5", "(3) - 2"), not the
# sign of the next number.
_OPERAND_END_MARKS = ")]}%"
_STRICT = re.compile(r"^\s*(-?)(\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")

MAX_RESPONSE_CHARS = 100_000
"""`extract_answer` reads a response's last this many characters only, where its answer is: a GSM8K solution is
a few hundred, and reading every number of a 1 MB response would take a second."""
MAX_NUMBER_CHARS = 100
"""A number (extracted, or given to `parse_number`) longer than this, or with a decimal exponent beyond it, is
not read: it is no answer to a GSM8K problem, and a million-digit one would take seconds to convert."""

_config = Gsm8kConfig()


def configure(cfg: Gsm8kConfig) -> None:
    """Set the extraction mode used by the `gsm8k` verifier in this process (the scorer calls it in each pool
    process)."""
    global _config
    _config = cfg


def _configure_from(reward: RewardConfig) -> None:
    configure(reward.gsm8k)


def normalize(text: str) -> str:
    return text.translate(_MINUS_SIGNS)


def parse_number(text: str) -> Fraction | None:
    """`"$1,234.50"` -> Fraction(2469, 2), `"−5"` -> -5; None when `text` is not a finite number, or is longer
    than MAX_NUMBER_CHARS characters, or has an exponent beyond that (`1e999999999`)."""
    if len(text) > MAX_NUMBER_CHARS:
        return None
    cleaned = normalize(text).replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        number = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not number.is_finite() or abs(number.as_tuple().exponent) > MAX_NUMBER_CHARS:
        return None
    return Fraction(number)


def _numbers(text: str) -> Iterator[str]:
    """Every number in `text`, with its sign when the minus is a sign: in "10 - 5" the numbers are 10 and 5."""
    for match in _NUMBER.finditer(text):
        sign, number = match.group(1), match.group(2)
        if sign and _ends_operand(text, match.start()):
            sign = ""
        yield sign + number.strip()


def _ends_operand(text: str, end: int) -> bool:
    """Whether `text[:end]`, trailing whitespace aside, ends in a digit or one of `)]}%`. Walks back over that
    whitespace only (never the whole prefix), so reading all numbers of a response stays linear."""
    i = end - 1
    while i >= 0 and text[i].isspace():
        i -= 1
    return i >= 0 and (text[i].isdecimal() or text[i] in _OPERAND_END_MARKS)


def extract_answer(response: str, mode: str | None = None) -> tuple[str | None, str]:
    """The answer text and where it came from: (`"18"`, `"marker"`), (`"18"`, `"last_number"`) or (None, "").
    `mode` (default: this process's `reward.gsm8k.mode`): `strict` takes only a number right after the last
    `####`; `flexible` takes the first number after the last `####`, else the last number of the response.
    Only the response's last MAX_RESPONSE_CHARS characters are read."""
    mode = _config.mode if mode is None else mode
    text = normalize(response[-MAX_RESPONSE_CHARS:])
    if mode == "strict":
        if GSM8K_MARKER not in text:
            return None, ""
        match = _STRICT.match(text.rsplit(GSM8K_MARKER, 1)[1])
        return (match.group(1) + match.group(2).strip(), "marker") if match else (None, "")
    if GSM8K_MARKER in text:
        first = next(_numbers(text.rsplit(GSM8K_MARKER, 1)[1]), None)
        if first is not None:
            return first, "marker"
    last = deque(_numbers(text), maxlen=1)
    if last:
        return last[0], "last_number"
    return None, ""


def verify_gsm8k(prompt: Prompt, response: str) -> VerifierResult:
    gold_text = gold_answer(prompt.answer)
    gold = parse_number(gold_text)
    if gold is None:
        raise ValueError(
            f"prompt {prompt.prompt_id}: gold answer {gold_text[:MAX_NUMBER_CHARS]!r} is not a number (of at most "
            f"{MAX_NUMBER_CHARS} characters); GSM8K gold answers follow `#### ` in the dataset's answer field "
            "(check data.answer_field)"
        )
    extracted, source = extract_answer(response)
    info = {"extracted": extracted, "gold": gold_text, "source": source}
    if extracted is not None and len(extracted) > MAX_NUMBER_CHARS:
        info["reason"] = "number_too_long"
        info["extracted"] = extracted[:MAX_NUMBER_CHARS] + "..."
        return VerifierResult(reward=0.0, correct=False, info=info)
    value = parse_number(extracted) if extracted is not None else None
    correct = value is not None and value == gold
    return VerifierResult(reward=1.0 if correct else 0.0, correct=correct, info=info)


SPEC = VerifierSpec(name="gsm8k", fn=verify_gsm8k, configure=_configure_from)
