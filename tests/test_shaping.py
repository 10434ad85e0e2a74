"""Reward shaping: DAPO soft overlong penalty, truncated-sample mask, zero-variance groups."""

import pytest
import torch

from learner.objective import apply_reward_shaping, zero_variance_groups
from learner.shaping import overlong_penalty
from protocols.algorithm import AlgorithmConfig


def test_overlong_penalty_is_zero_then_linear_then_minus_one():
    # L_max 100, L_cache 20: penalty starts after 80 tokens; 90 -> (80 - 90) / 20 = -0.5; 100 -> -1; 120 -> -1
    pen = overlong_penalty(torch.tensor([50, 80, 90, 100, 120]), 100, 20)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_overlong_buffer_must_fit():
    with pytest.raises(ValueError, match="must be in \\(0, max_response_tokens=100\\)"):
        overlong_penalty(torch.tensor([10]), 100, 100)


def test_dapo_shaping_uses_fraction_of_max_tokens():
    # DAPO preset: buffer 0.2 * 100 = 20 tokens; length 95 -> (80 - 95) / 20 = -0.75 added to reward 1
    shaped, keep = apply_reward_shaping(torch.tensor([1.0, 1.0]), torch.tensor([50, 95]), torch.tensor([False, False]),
                                        AlgorithmConfig(preset="dapo"), max_response_tokens=100)
    torch.testing.assert_close(shaped, torch.tensor([1.0, 0.25]))
    assert keep.tolist() == [True, True]


def test_mask_truncated_drops_truncated_samples():
    cfg = AlgorithmConfig(preset="grpo", mask_truncated=True)
    shaped, keep = apply_reward_shaping(torch.tensor([1.0, 0.0]), torch.tensor([10, 100]),
                                        torch.tensor([False, True]), cfg, max_response_tokens=100)
    assert keep.tolist() == [True, False] and shaped.tolist() == [1.0, 0.0]


def test_no_shaping_by_default():
    shaped, keep = apply_reward_shaping(torch.tensor([0.5]), torch.tensor([100]), torch.tensor([True]),
                                        AlgorithmConfig(preset="grpo"), max_response_tokens=100)
    assert shaped.tolist() == [0.5] and keep.tolist() == [True]


def test_zero_variance_groups_for_dynamic_sampling():
    # groups of 3: [1, 1, 1] no signal, [1, 0, 1] signal
    assert zero_variance_groups(torch.tensor([1.0, 1, 1, 1, 0, 1]), 3).tolist() == [True, False]
