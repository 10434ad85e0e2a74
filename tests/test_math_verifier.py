"""LaTeX math verifier: \\boxed extraction and equivalence by kind, each with a positive and a negative case."""

import time

import pytest

from protocols.trajectory import Prompt
from rewards.math_answer import MAX_ANSWER_DEPTH, gold_answer, is_equivalent, last_boxed, normalize, verify_math


def test_last_boxed_balances_nested_braces():
    assert last_boxed(r"first \boxed{1}, then \boxed{\frac{\sqrt{3}}{2}} done") == r"\frac{\sqrt{3}}{2}"


def test_unclosed_or_missing_boxed_is_none():
    assert last_boxed(r"\boxed{\frac{1}{2}") is None
    assert last_boxed("the answer is 3") is None


def test_gold_from_math_solution_is_its_last_boxed():
    assert gold_answer(r"So $x = \boxed{5}$.") == "5"
    assert gold_answer(r"\frac{1}{2}") == r"\frac{1}{2}"


@pytest.mark.parametrize(
    ("gold", "candidate", "equal"),
    [
        # fractions: 1/2 = 0.5 = \dfrac12, but not 1/3
        (r"\frac{1}{2}", "0.5", True),
        (r"\frac{1}{2}", r"\dfrac12", True),
        (r"\frac{1}{2}", r"\frac{1}{3}", False),
        # radicals: sqrt(8) = 2 sqrt(2); sqrt(3)/2 = (1/2) sqrt(3); but 2 sqrt(2) != sqrt(2)
        (r"2\sqrt{2}", r"\sqrt{8}", True),
        (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}", True),
        (r"2\sqrt{2}", r"\sqrt{2}", False),
        # pi: 2 pi vs 6.283185307 (equal to 6 places), not pi
        (r"2\pi", "6.283185307", True),
        (r"2\pi", r"\pi", False),
        # intervals: endpoints and brackets matter
        (r"[1, 3)", r"[1,3)", True),
        (r"(-\infty, 2]", r"(-\infty,2]", True),
        (r"(1,3]", r"[1,3)", False),
        # sets are unordered
        (r"\{1,2,3\}", r"\{3,2,1\}", True),
        (r"\{1,2\}", r"\{1,3\}", False),
        # tuples are ordered
        (r"(1,2,3)", r"(1,2,3)", True),
        (r"(1,2,3)", r"(3,2,1)", False),
        # percentages: 50\% is 50 (and 1/2); not 40
        (r"50\%", "50", True),
        (r"50\%", r"40\%", False),
        # degrees: 30^\circ is 30, not 60
        (r"30^\circ", "30", True),
        (r"30^\circ", r"60^\circ", False),
        # \text answers compare case-insensitively as words
        (r"\text{Monday}", r"\text{monday}", True),
        (r"\text{Monday}", r"\text{Tuesday}", False),
        # equations: x = 3 matches 3 and x=3; not x = 4
        ("x = 3", "3", True),
        ("3", "x=3", True),
        ("x = 3", "x = 4", False),
    ],
)
def test_equivalence(gold, candidate, equal):
    assert is_equivalent(gold, candidate) is equal


def test_verify_math_scores_last_boxed_and_reports_it():
    prompt = Prompt(prompt_id="math/test/0", prompt_token_ids=[0], answer=r"\frac{1}{2}")
    right = verify_math(prompt, r"half: \boxed{0.5}")
    assert (right.reward, right.correct, right.info["extracted"]) == (1.0, True, "0.5")
    assert verify_math(prompt, r"\boxed{0.5} no wait \boxed{2}").reward == 0.0


def test_no_boxed_and_overlong_answers_score_zero():
    prompt = Prompt(prompt_id="math/test/0", prompt_token_ids=[0], answer="3")
    assert verify_math(prompt, "the answer is 3").info["reason"] == "no_boxed"
    assert verify_math(prompt, r"\boxed{" + "1+" * 500 + "1}").info["reason"] == "answer_too_long"


def test_empty_gold_against_empty_box_scores_zero():
    # Neither side parses and both are empty: nothing was checked, so 0 (the old string fallback gave 1).
    prompt = Prompt(prompt_id="math/test/0", prompt_token_ids=[0], answer="")
    assert verify_math(prompt, r"the answer is \boxed{}").reward == 0.0
    assert is_equivalent("", "") is False
    assert is_equivalent("   ", "$ $") is False


@pytest.mark.parametrize(
    ("gold", "candidate", "equal"),
    [
        # "???" is no mathematical object: equal only to itself (after normalization), never to another text
        ("???", "???", True),
        ("???", " ??? ", True),
        ("???", "!!!", False),
        # a parsable answer against an unparsable gold (and the reverse) is compared as text: 3 is not "???"
        ("???", "3", False),
        ("3", "???", False),
        # normalization: $, spacing commands, \left/\right, \dfrac and a trailing period do not count
        (r"\{", r"$\{$.", True),
        (r"\left\{ \right.", r"\{", True),
        (r"\{", r"\}", False),
    ],
)
def test_unparsable_answers_match_only_when_identical_after_normalization(gold, candidate, equal):
    assert is_equivalent(gold, candidate) is equal


def test_normalization_rules():
    # "$\left( a, b \right).$": drop $, the period, \left, \right and spaces -> "(a,b)"
    assert normalize(r"$\left( a, b \right).$") == "(a,b)"
    # \dfrac and \tfrac are \frac; \, \; \! and ~ are spacing
    assert normalize(r"\dfrac{1}{2}\,\;\!~") == r"\frac{1}{2}"
    # \leftarrow is a command of its own, not \left
    assert normalize(r"\leftarrow") == r"\leftarrow"


# ----- hostile answers: refused by a bound, quickly, never raised ----------------------------------------------
def _reason(answer: str, gold: str = "3") -> tuple[bool, str | None]:
    result = verify_math(Prompt(prompt_id="math/test/0", prompt_token_ids=[0], answer=gold), r"\boxed{" + answer + "}")
    return result.correct, result.info.get("reason")


@pytest.mark.parametrize("answer", [
    "9^{9^{9^9}}",                    # 9^(9^(9^9)): about 10^369693099 digits
    "10^{10^{10}}",                   # 10^10 + 1 digits
    "2^{3322}",                       # 3322 log10(2) = 1000.02: 1001 digits
    "450!",                           # log10(450!) = 1000.2
    r"\sum_{i=1}^{10^{9}} i",         # a range of 10^9
    "(x+1)^{101}",                    # expanding a sum past MAX_ANSWER_EXPONENT = 100
    "(a+b+c)^{100}",                  # C(102, 2) = 5,151 terms once expanded: past MAX_EXPANDED_TERMS = 300
    "(a+b+c+d+e)^{20}",               # C(24, 4) = 10,626 terms
    "(x+1)^{100}(y+1)^{100}",         # 101 x 101 = 10,201 terms
    r"\gcd(10^{10^{10}}, 7)",         # math-verify computes gcd while reading
    r"\binom{100000}{50000}",         # and binomials: a number over MAX_EAGER_DIGITS = 4 digits
    r"\Gamma(\Gamma(\Gamma(5)))",     # and Gamma: more than one of them
])  # fmt: skip
def test_huge_numbers_are_refused_before_they_are_computed(answer):
    start = time.perf_counter()
    assert _reason(answer) == (False, "answer_too_large")
    assert time.perf_counter() - start < 5.0  # computing the first would exhaust any memory


@pytest.mark.parametrize(("answer", "gold"), [
    ("2^{3321}", "2^{3321}"),         # 3321 log10(2) = 999.7: 1000 digits, compared
    ("449!", "449!"),                 # log10(449!) = 997.5
    ("(x+1)^{2}", "x^2+2x+1"),        # a small power of a sum is expanded and compared
    (r"\binom{5}{2}", "10"),          # one small binomial is read
    ("(x+y)^{2}(x-y)", "x^3+x^2y-xy^2-y^3"),  # 3 x 2 = 6 terms at most, expanded and compared
])  # fmt: skip
def test_numbers_within_the_bounds_are_compared(answer, gold):
    assert _reason(answer, gold) == (True, None)


def test_nesting_past_the_depth_bound_is_refused():
    # 7 nested parentheses: one level over MAX_ANSWER_DEPTH = 6; 6 are still read (and equal 3)
    assert MAX_ANSWER_DEPTH == 6
    assert _reason("(" * 7 + "3" + ")" * 7) == (False, "answer_too_deep")
    assert _reason("(" * 6 + "3" + ")" * 6) == (True, None)


def test_chained_scripts_count_as_nesting():
    # x^x^x^x^x^x^x^x: 7 `^` in one term, 7 levels; x^2+y^2+z^2+w^2+v^2+u^2+t^2: 7 `^`, but 1 level per term
    assert _reason("x^x^x^x^x^x^x^x") == (False, "answer_too_deep")
    assert _reason("x^2+y^2+z^2+w^2+v^2+u^2+t^2") == (False, None)


def test_100000_deep_braces_and_a_megabyte_answer_are_refused_by_length():
    # 200,000 characters of braces, then 10^6 digits: both over MAX_ANSWER_CHARS = 400, refused unread
    start = time.perf_counter()
    assert _reason("{" * 100_000 + "}" * 100_000) == (False, "answer_too_long")
    assert _reason("1" * 1_000_000) == (False, "answer_too_long")
    assert time.perf_counter() - start < 1.0


def test_a_megabyte_response_is_read_for_its_last_boxed_answer():
    # a 10^6-character response ending in \boxed{3}: found by a linear scan, and correct
    prompt = Prompt(prompt_id="math/test/0", prompt_token_ids=[0], answer="3")
    assert verify_math(prompt, "{" * 1_000_000 + r" so \boxed{3}").correct


def test_a_refused_candidate_is_never_equivalent():
    assert is_equivalent("3", "(((((((3)))))))") is False


def test_the_expanded_terms_bound_multiplies_products_and_counts_powers_of_sums_as_multinomials():
    from rewards.math_answer import MAX_EXPANDED_TERMS, _expanded_terms, _parse

    def terms(answer):
        return _expanded_terms(_parse(answer)[0])

    # (x+1)^100: C(101, 1) = 101; (a+b+c)^10: C(12, 2) = 66; (x+y)^3 (x-y): 4 x 2 = 8; sqrt(2) and 5 are one term
    assert MAX_EXPANDED_TERMS == 300
    assert [terms("(x+1)^{100}"), terms("(a+b+c)^{10}"), terms("(x+y)^{3}(x-y)"), terms(r"5\sqrt{2}")] == [
        101, 66, 8, 1]
    # (a+b+c)^{20}: C(22, 2) = 231, under the bound; (a+b+c)^{30}: C(32, 2) = 496, over it
    assert terms("(a+b+c)^{20}") == 231 and terms("(a+b+c)^{30}") == float("inf")
