"""LaTeX math verifier: the last `\\boxed{...}` of the response, compared with the gold answer by
`math-verify` (symbolic and numeric equality of fractions, radicals, pi, intervals, sets, tuples,
percentages, degrees, `\\text{}` answers and equations such as `x = 3`). When either side does not parse to
a mathematical object, only answers identical after `normalize` count, and an empty answer never does.
"""

import logging
import math
import re

import sympy
from math_verify import parse, verify

from protocols.trajectory import Prompt, VerifierResult
from rewards.answer_formats import last_boxed
from rewards.spec import VerifierSpec

MAX_ANSWER_CHARS = 400
"""A longer answer is refused (`answer_too_long`) before math-verify reads it."""
MAX_ANSWER_DEPTH = 6
"""An answer nested deeper than this is refused (`answer_too_deep`) before it is read. Each open bracket `( [ {`
is a level, and so is each `^` or `_` until its term ends (at `+ - = , ;` or its bracket's close): `x^{y^{2}}`
is 4 deep, `x^y^z` 2, `x^2+y^2` 1. math-verify's parser takes about 0.1 s more per level (199 brackets took 6 s,
a chain of 20 `^` 6 s); real answers are 4 deep at most (`\\left(\\frac{\\sqrt{3}}{x^{2}}\\right)`)."""
MAX_ANSWER_DIGITS = 1000
"""A parsed answer is refused (`answer_too_large`) before it is compared when a number in it, or one computed
from it (a power, a factorial, a sum's or a product's range), could have more digits than this: comparing
`9^{9^{9^9}}` would compute a number of 10^369693099 digits, in C code that no timeout interrupts."""
MAX_ANSWER_EXPONENT = 100
"""A parsed answer is refused (`answer_too_large`) when it raises a sum (`(x+1)^{1000}`) to a power over this:
comparing it expands the power (14 s for 1000, 0.7 s for 100)."""
MAX_EXPANDED_TERMS = 300
"""A parsed answer is refused (`answer_too_large`) when expanding its products and powers of sums could give more
terms than this (`(a+b+c)^{100}` has 5,151): comparing expands them, at about 5 ms a term (`(a+b+c)^{100}` took
24 s, `(x+1)^{100}(y+1)^{100}` with 10,201 terms 52 s), so MAX_ANSWER_EXPONENT alone bounds one variable only."""
MAX_EAGER_DIGITS = 4
"""math-verify computes `\\binom`, `\\choose`, `\\gcd`, `lcm` and `\\Gamma` while it reads an answer, before any
bound above can look: an answer that uses one of them is refused (`answer_too_large`) unless it uses one only,
its numbers have at most this many digits and it has no `^` or `!` (reading `\\gcd(10^{10^{10}}, 7)` or
`\\Gamma(\\Gamma(\\Gamma(5)))` had not finished after 10 s)."""
_EAGER = re.compile(r"binom|choose|gcd|lcm|Gamma")
_EAGER_TOO_BIG = re.compile(r"[\^!]|\d{%d}" % (MAX_EAGER_DIGITS + 1))
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
    gold against `\\boxed{}` is 0, and an unparsable answer never matches by a loose comparison. A candidate
    refused by the size bounds (`compare`) is never equivalent."""
    return compare(gold, candidate)[0]


def compare(gold: str, candidate: str) -> tuple[bool, str]:
    """(equivalent, why the candidate was refused: "" or `answer_too_long`, `answer_too_deep`,
    `answer_too_large`). The candidate is model output: it is read only within MAX_ANSWER_CHARS,
    MAX_ANSWER_DEPTH and MAX_EAGER_DIGITS, and compared only within MAX_ANSWER_DIGITS and MAX_ANSWER_EXPONENT."""
    if len(candidate) > MAX_ANSWER_CHARS:
        return False, "answer_too_long"
    if _nesting_depth(candidate) > MAX_ANSWER_DEPTH:
        return False, "answer_too_deep"
    eager = len(_EAGER.findall(candidate))
    if eager > 1 or (eager and _EAGER_TOO_BIG.search(candidate)):
        return False, "answer_too_large"
    gold_parsed = _parse(gold)
    candidate_parsed = _parse(candidate)
    if not _parsed(gold_parsed) or not _parsed(candidate_parsed):
        return normalize(gold) != "" and normalize(gold) == normalize(candidate), ""
    if any(_digits_bound(item) > MAX_ANSWER_DIGITS or _expanded_terms(item) > MAX_EXPANDED_TERMS
           for item in candidate_parsed if not isinstance(item, str)):
        return False, "answer_too_large"
    return bool(verify(gold_parsed, candidate_parsed, timeout_seconds=None)), ""


def _nesting_depth(text: str) -> int:
    """How deep `text` nests (MAX_ANSWER_DEPTH says how levels count; `\\{` and `\\left(` count as their
    bracket; a stray closer is skipped). One pass, no recursion."""
    scripts = [0]  # per open bracket: the `^`/`_` of the current term at that level
    depth = deepest = 0
    for char in text:
        if char in "([{":
            scripts.append(0)
            depth += 1
        elif char in ")]}":
            if len(scripts) > 1:
                depth -= 1 + scripts.pop()
        elif char in "^_":
            scripts[-1] += 1
            depth += 1
        elif char in "+-=,;":
            depth -= scripts[-1]
            scripts[-1] = 0
        deepest = max(deepest, depth)
    return deepest


_GROWTH = (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.binomial, sympy.RisingFactorial,
           sympy.FallingFactorial, sympy.gamma, sympy.Sum, sympy.Product)
"""Functions whose value (or cost) grows like n! with their largest argument n."""


def _digits_bound(expr: object) -> float:
    """An upper bound of log10 of the largest number sympy may compute from `expr` (about its digits; a symbol
    counts as 1), without computing any: math.inf once that passes MAX_ANSWER_DIGITS, or when a sum is raised
    to a power over MAX_ANSWER_EXPONENT. Recursion is as deep as the parsed answer, which MAX_ANSWER_CHARS
    bounds."""
    if isinstance(expr, sympy.MatrixBase):
        return _saturated(sum(_digits_bound(entry) for entry in expr))
    if not isinstance(expr, sympy.Basic):
        return 0.0
    if isinstance(expr, sympy.Rational):  # Integer too; math.log10 takes an int of any size
        return _saturated(math.log10(max(abs(int(expr.p)), int(expr.q))))
    if isinstance(expr, sympy.Float):
        size = abs(float(expr))  # inf past the float range, 0.0 under it
        return _saturated(abs(math.log10(size))) if size else 0.0
    if not expr.args:
        return 1.0 if expr.is_number else 0.0  # pi, E, I, oo; a symbol
    args = [_digits_bound(arg) for arg in expr.args]
    if math.inf in args:
        return math.inf
    if isinstance(expr, sympy.Pow):
        times = _power_of_ten(args[1])  # the exponent's size
        if times == math.inf or (expr.base.free_symbols and expr.base.atoms(sympy.Add) and times > MAX_ANSWER_EXPONENT):
            return math.inf
        return _saturated(args[0] * times)
    if isinstance(expr, sympy.exp):
        return _saturated(_power_of_ten(args[0]) / math.log(10))
    if isinstance(expr, _GROWTH):
        n = _power_of_ten(max(args))
        return _saturated(math.lgamma(n + 1) / math.log(10))  # log10(n!)
    if isinstance(expr, sympy.Add):
        return _saturated(max(args) + math.log10(len(args)))
    # A product, and any other function or container (sqrt, sin, sets, tuples): at most a product of its parts.
    return _saturated(sum(args))


def _expanded_terms(expr: object) -> float:
    """An upper bound of the terms `expr` has once its products and integer powers of sums are expanded: a sum
    adds its parts' counts, a product multiplies them, a sum of t terms to the power n has C(n + t - 1, t - 1).
    math.inf past MAX_EXPANDED_TERMS. Recursion is as deep as the parsed answer, which MAX_ANSWER_CHARS bounds."""
    if isinstance(expr, sympy.MatrixBase):
        return _capped(sum(_expanded_terms(entry) for entry in expr))
    if not isinstance(expr, (sympy.Add, sympy.Mul, sympy.Pow)) or not expr.free_symbols:
        return 1.0  # a number, a symbol, or a function, whose arguments are not expanded into its terms
    if isinstance(expr, sympy.Pow):
        base, n = _expanded_terms(expr.base), expr.exp
        if not (n.is_Integer and n > 1) or base == 1:
            return base
        return math.inf if base == math.inf or n > 10**6 else _capped(math.comb(int(n) + int(base) - 1, int(base) - 1))
    counts = [_expanded_terms(arg) for arg in expr.args]
    return _capped(sum(counts) if isinstance(expr, sympy.Add) else math.prod(counts))


def _capped(terms: float) -> float:
    return math.inf if terms > MAX_EXPANDED_TERMS else terms


def _power_of_ten(log10_size: float) -> float:
    # An exponent or a factorial's argument over 10^300 (past the float range soon after) is refused outright.
    return math.inf if log10_size > 300 else 10.0**log10_size


def _saturated(log10_size: float) -> float:
    return math.inf if log10_size > MAX_ANSWER_DIGITS else log10_size


def verify_math(prompt: Prompt, response: str) -> VerifierResult:
    gold = gold_answer(prompt.answer)
    extracted = last_boxed(response)
    info: dict = {"extracted": extracted, "gold": gold}
    if extracted is None:
        info["reason"] = "no_boxed"
        return VerifierResult(reward=0.0, correct=False, info=info)
    correct, refused = compare(gold, extracted)
    if refused:
        info["reason"] = refused
        if len(extracted) > MAX_ANSWER_CHARS:
            info["extracted"] = extracted[:MAX_ANSWER_CHARS] + "..."
    return VerifierResult(reward=1.0 if correct else 0.0, correct=correct, info=info)


SPEC = VerifierSpec(name="math", fn=verify_math)
