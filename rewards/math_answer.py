"""LaTeX math verifier: the last `\\boxed{...}` of the response, compared with the gold answer by
`math-verify` (symbolic and numeric equality of fractions, radicals, pi, intervals, sets, tuples,
percentages, degrees, `\\text{}` answers and equations such as `x = 3`). When either side does not parse to
a mathematical object, only answers identical after `normalize` count, and an empty answer never does.
"""

import logging
import re

from math_verify import parse, verify

from protocols.trajectory import Prompt, VerifierResult
from rewards.answer_formats import last_boxed
from rewards.spec import VerifierSpec

# Parsing an adversarial expression (`9^{9^{9^9}}`) can run for ever; longer answers than this are refused
# before sympy sees them, and the scorer's per-sample timeout covers the rest.
MAX_ANSWER_CHARS = 400
# Spacing and sizing commands that never change an answer's meaning.
_NO_MEANING = re.compile(r"\\left(?![a-zA-Z])|\\right(?![a-zA-Z])|\\[,;:! ]|~|\s+")


def _drop_timeout_notice(record: logging.LogRecord) -> bool:
    # math-verify warns once per process that its own timeout is off; the scorer's timeout is on instead.
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_drop_timeout_notice)


def gold_answer(answer: str) -> str:
    """A MATH `solution` holds the answer in its last `\\boxed{}`; a bare answer is used as is."""
    boxed = last_boxed(answer)
    return boxed if boxed is not None else answer.strip()


def _parse(latex: str) -> list:
    # Timeouts inside math-verify use SIGALRM, which clashes with the scorer's own and fails outside the main
    # thread; the scorer enforces the limit instead.
    return parse(f"${latex}$", parsing_timeout=None)


def normalize(latex: str) -> str:
    """The text compared when an answer does not parse: surrounding `$` and a trailing period dropped, all
    whitespace and the spacing commands `\\, \\; \\: \\! \\ ` and `~` removed, `\\left`/`\\right` dropped,
    `\\dfrac`/`\\tfrac` written `\\frac`. `"$\\left( a, b \\right).$"` -> `"(a,b)"`."""
    text = latex.strip().rstrip(".").strip("$").strip().rstrip(".")
    text = _NO_MEANING.sub("", text)
    return text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def _parsed(result: list) -> bool:
    # math-verify returns [sympy object, text] when it understood the answer, [text] or [] when not.
    return any(not isinstance(item, str) for item in result)


def is_equivalent(gold: str, candidate: str) -> bool:
    """True when the two LaTeX answers denote the same value (gold first: math-verify is not symmetric).
    If either does not parse, True only when both are identical after `normalize` and not empty: an empty
    gold against `\\boxed{}` is 0, and an unparsable answer never matches by a loose comparison."""
    gold_parsed = _parse(gold)
    candidate_parsed = _parse(candidate)
    if not _parsed(gold_parsed) or not _parsed(candidate_parsed):
        return normalize(gold) != "" and normalize(gold) == normalize(candidate)
    return bool(verify(gold_parsed, candidate_parsed, timeout_seconds=None))


def verify_math(prompt: Prompt, response: str) -> VerifierResult:
    gold = gold_answer(prompt.answer)
    extracted = last_boxed(response)
    info: dict = {"extracted": extracted, "gold": gold}
    if extracted is None:
        info["reason"] = "no_boxed"
        return VerifierResult(reward=0.0, correct=False, info=info)
    if len(extracted) > MAX_ANSWER_CHARS:
        info["reason"] = "answer_too_long"
        info["extracted"] = extracted[:MAX_ANSWER_CHARS] + "..."
        return VerifierResult(reward=0.0, correct=False, info=info)
    correct = is_equivalent(gold, extracted)
    return VerifierResult(reward=1.0 if correct else 0.0, correct=correct, info=info)


SPEC = VerifierSpec(name="math", fn=verify_math)
