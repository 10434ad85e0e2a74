"""Unbiased pass@k against hand-computed binomials."""

import math

import pytest

from rewards.pass_at_k import mean_pass_at_k, pass_at_k, powers_of_two_up_to


def test_pass_at_1_is_the_fraction_correct():
    # n=5, c=2: 1 - C(3,1)/C(5,1) = 1 - 3/5 = 0.4
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)


def test_pass_at_2_by_hand():
    # n=5, c=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)


def test_pass_at_3_and_4_by_hand():
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9; k=4: C(3,4)=0, so 1
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0


def test_pass_at_k_edges():
    # nothing correct: 0 for every k; everything correct: 1
    assert [pass_at_k(4, 0, k) for k in (1, 2, 4)] == [0.0, 0.0, 0.0]
    assert [pass_at_k(4, 4, k) for k in (1, 2, 4)] == [1.0, 1.0, 1.0]
    # n=8, c=1, k=8: every draw of all 8 holds the correct one
    assert pass_at_k(8, 1, 8) == 1.0


def test_pass_at_k_equals_the_binomial_form_and_stays_finite_for_large_n():
    for n, c, k in [(10, 3, 4), (16, 5, 8), (20, 1, 7)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    # C(2000, 1000) overflows a float; the product form does not (and 1 correct in 2000, k=1 is 1/2000)
    assert pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)
    assert 0.0 < pass_at_k(2000, 3, 1000) < 1.0


def test_pass_at_k_is_monotone_in_k():
    for n, c in [(5, 2), (16, 3), (16, 0), (32, 31)]:
        values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))


def test_mean_over_prompts():
    # prompts (5,2) and (5,0): pass@1 = (0.4 + 0) / 2 = 0.2; pass@2 = (0.7 + 0) / 2 = 0.35
    assert mean_pass_at_k([(5, 2), (5, 0)], 1) == pytest.approx(0.2)
    assert mean_pass_at_k([(5, 2), (5, 0)], 2) == pytest.approx(0.35)
    assert math.isnan(mean_pass_at_k([], 1))


def test_reported_ks_are_powers_of_two_up_to_the_samples():
    assert powers_of_two_up_to(1) == [1]
    assert powers_of_two_up_to(4) == [1, 2, 4]
    assert powers_of_two_up_to(6) == [1, 2, 4, 6]
    assert powers_of_two_up_to(0) == []


def test_bad_arguments_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="k=5 must be between 1 and the sample count n=4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 1)
