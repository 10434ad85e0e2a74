"""Micro-batch planning: balanced ranks, token budgets that hold, long samples alone, equal counts on all ranks."""

import random

import pytest

from learner.micro_batches import (
    karmarkar_karp,
    micro_batch_count,
    plan_ranks,
    sample_count_micro_batches,
    token_budget_micro_batches,
)


def loads(parts, tokens):
    return [sum(tokens[i] for i in p) for p in parts]


def test_karmarkar_karp_follows_largest_differencing():
    # [4, 5, 6, 7, 8] over 2: replace 8, 7 by their difference 1 -> {1, 4, 5, 6}; 6, 5 -> 1 -> {1, 1, 4};
    # 4, 1 -> 3 -> {1, 3}; 3, 1 -> 2. Unwinding puts 8 against 7, 6 against 5 and 4 with 7 and 5:
    # {4, 5, 7} = 16 and {6, 8} = 14, a difference of 2 (the best split, 15 | 15, is not LDM's).
    tokens = [4, 5, 6, 7, 8]
    assert karmarkar_karp(tokens, 2) == [[0, 1, 3], [2, 4]]
    # [3, 1, 1, 2, 2, 1]: a perfect 5 | 5
    assert loads(karmarkar_karp([3, 1, 1, 2, 2, 1], 2), [3, 1, 1, 2, 2, 1]) == [5, 5]


def test_karmarkar_karp_balances_a_long_tailed_batch():
    rng = random.Random(0)
    tokens = [int(min(16384, rng.lognormvariate(8.0, 0.8))) for _ in range(128)]
    parts = karmarkar_karp(tokens, 4)
    assert sorted(i for p in parts for i in p) == list(range(128))
    assert max(loads(parts, tokens)) - min(loads(parts, tokens)) <= max(tokens)
    # equal_size keeps 32 samples per rank (sample-count micro-batches need it)
    equal = karmarkar_karp(tokens, 4, equal_size=True)
    assert [len(p) for p in equal] == [32, 32, 32, 32]
    assert max(loads(equal, tokens)) - min(loads(equal, tokens)) <= max(tokens)


def test_equal_size_keeps_sizes_one_apart_when_the_parts_do_not_divide_the_items():
    # [1, 2, 3] over 2: seeds {0, 1} (parts 2 | 1) and {2} (parts 3 | empty), the larger difference; merged
    # crosswise: 3 + 1 = {0, 2} and 0 + 2 = {1}, sizes 2 and 1 (the critic's ranks take whole batches of any size)
    assert karmarkar_karp([1, 2, 3], 2, equal_size=True) == [[0, 2], [1]]


def test_budget_micro_batches_hold_the_budget_and_are_about_equal():
    rng = random.Random(1)
    tokens = [rng.randint(10, 300) for _ in range(40)]
    budget = 1000
    parts = token_budget_micro_batches(tokens, budget)
    assert sorted(i for p in parts for i in p) == list(range(40))
    assert max(loads(parts, tokens)) <= budget
    # the fewest micro-batches that can hold the tokens is ceil(total / budget); greedy may need one more
    assert len(parts) <= -(-sum(tokens) // budget) + 1


def test_sample_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    # 500 > 100: alone, whole; the two short ones share one micro-batch (20 <= 100)
    assert token_budget_micro_batches([500, 10, 10], 100) == [[0], [1, 2]]


def test_count_pads_with_splits_then_empty_micro_batches():
    # asked for 3 micro-batches of 2 samples that fit in one: split to [[0], [1]], then one empty
    assert token_budget_micro_batches([30, 20], 100, count=3) == [[0], [1], []]


def test_every_rank_runs_the_count_of_the_busiest_rank():
    # rank 0: 250 tokens at budget 100 -> 3 micro-batches; rank 1: 90 tokens -> 1; both run 3
    per_rank = [[100, 100, 50], [90]]
    count = micro_batch_count(per_rank, 100)
    assert count == 3
    assert [len(token_budget_micro_batches(t, 100, count=count)) for t in per_rank] == [3, 3]


def test_sample_count_plan_keeps_equal_samples_per_rank():
    tokens = [1000, 10, 10, 10, 10, 10, 10, 10]
    parts = plan_ranks(tokens, 2, budget=0)
    assert [len(p) for p in parts] == [4, 4]
    assert sample_count_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]


def test_budget_of_zero_is_refused_by_the_budget_planner():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=0"):
        token_budget_micro_batches([1, 2], 0)
