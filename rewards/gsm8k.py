"""GSM8K verifier: the answer number taken from the response (`strict`: only the number right after the last
`####`, as verl's default; `flexible`: that, else the response's last number) compared with the gold number
(the one after `#### ` in the dataset's `answer` field) as exact rationals.
"""

import re
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
# What a minus between two of these is: subtraction ("10 - 5", "(3) - 2"), not the sign of the next number.
_OPERAND_END = re.compile(r"[\d)\]}%]\s*$")
_STRICT = re.compile(r"^\s*(-?)(\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")

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
    """`"$1,234.50"` -> Fraction(2469, 2), `"−5"` -> -5; None when `text` is not a number."""
    cleaned = normalize(text).replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(Decimal(cleaned))
    except (InvalidOperation, ValueError):
        return None


def _numbers(text: str) -> list[str]:
    """Every number in `text`, with its sign when the minus is a sign: in "10 - 5" the numbers are 10 and 5."""
    found = []
    for match in _NUMBER.finditer(text):
        sign, number = match.group(1), match.group(2)
        if sign and _OPERAND_END.search(text, 0, match.start()):
            sign = ""
        found.append(sign + number.strip())
    return found


def extract_answer(response: str, mode: str | None = None) -> tuple[str | None, str]:
    """The answer text and where it came from: (`"18"`, `"marker"`), (`"18"`, `"last_number"`) or (None, "").
    `mode` (default: this process's `reward.gsm8k.mode`): `strict` takes only a number right after the last
    `####`; `flexible` takes the first number after the last `####`, else the last number of the response."""
    mode = _config.mode if mode is None else mode
    text = normalize(response)
    if mode == "strict":
        if GSM8K_MARKER not in text:
            return None, ""
        match = _STRICT.match(text.rsplit(GSM8K_MARKER, 1)[1])
        return (match.group(1) + match.group(2).strip(), "marker") if match else (None, "")
    if GSM8K_MARKER in text:
        after = _numbers(text.rsplit(GSM8K_MARKER, 1)[1])
        if after:
            return after[0], "marker"
    numbers = _numbers(text)
    if numbers:
        return numbers[-1], "last_number"
    return None, ""


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


SPEC = VerifierSpec(name="gsm8k", fn=verify_gsm8k, configure=_configure_from)
