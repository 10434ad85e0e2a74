"""The distillation benchmark's final evaluation: the whole held-out split and the paired gap to the teacher."""

import math

import pytest

from benchmarks.distillation import paired_gap, whole_test_split
from rewards.arithmetic_data import arithmetic_problems


def test_paired_gap_is_the_mean_difference_and_its_standard_error():
    teacher = {"a": True, "b": True, "c": False, "d": True, "only_teacher": True}
    student = {"a": True, "b": False, "c": True, "d": False}
    # Differences over the 4 shared ids: 0, 1, -1, 1 -> mean 0.25; sample variance 2.75 / 3; se = sqrt(var / 4).
    gap, stderr = paired_gap(teacher, student)
    assert gap == pytest.approx(0.25)
    assert stderr == pytest.approx(math.sqrt(2.75 / 3 / 4))


def test_paired_gap_refuses_fewer_than_two_shared_problems():
    with pytest.raises(ValueError, match="at least 2"):
        paired_gap({"a": True}, {"a": False, "b": True})


def test_whole_test_split_counts_every_held_out_pair_the_generator_can_draw():
    config = {"data": {"arithmetic_min_operand": 0, "arithmetic_max_operand": 99}}
    size = whole_test_split(config)
    assert len(arithmetic_problems(99, "test", size)) == size
    with pytest.raises(ValueError, match=f"the test split has {size} pairs"):
        arithmetic_problems(99, "test", size + 1)
