"""Advantage estimators against hand-derived values."""

import math

import pytest
import torch

from learner.advantages import (
    gae_advantage,
    group_mean_advantage,
    grpo_advantage,
    reinforce_pp_advantage,
    rloo_advantage,
    token_level_rewards,
    zero_variance_groups,
)
from learner.objective import compute_advantages
from protocols.algorithm import AlgorithmConfig

GROUP_A = [1.0, 1.0, 0.0, 1.0, 0.0]  # mean 0.6, deviations [.4, .4, -.6, .4, -.6], sum of squares 1.2
GROUP_B = [0.0, 0.0, 1.0, 0.0]  # mean 0.25, deviations [-.25, -.25, .75, -.25], sum of squares 0.75


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_grpo_advantage_sample_std():
    # A: sample var 1.2/4 = 0.3, std 0.547723: 0.4/0.547723 = 0.730297, -0.6/0.547723 = -1.095445
    a = grpo_advantage(t(GROUP_A), 5, std="sample")
    torch.testing.assert_close(a, t([0.730297, 0.730297, -1.095445, 0.730297, -1.095445]), atol=1e-5, rtol=0)
    # B: sample var 0.75/3 = 0.25, std 0.5: -0.25/0.5 = -0.5, 0.75/0.5 = 1.5
    b = grpo_advantage(t(GROUP_B), 4, std="sample")
    torch.testing.assert_close(b, t([-0.5, -0.5, 1.5, -0.5]), atol=1e-5, rtol=0)


def test_grpo_advantage_population_std():
    # A: population var 1.2/5 = 0.24, std 0.489898: 0.4/0.489898 = 0.816497, -0.6/0.489898 = -1.224745
    a = grpo_advantage(t(GROUP_A), 5, std="population")
    torch.testing.assert_close(a, t([0.816497, 0.816497, -1.224745, 0.816497, -1.224745]), atol=1e-5, rtol=0)
    # B: population var 0.75/4 = 0.1875, std 0.433013: -0.25/0.433013 = -0.577350, 0.75/0.433013 = 1.732051
    b = grpo_advantage(t(GROUP_B), 4, std="population")
    torch.testing.assert_close(b, t([-0.577350, -0.577350, 1.732051, -0.577350]), atol=1e-5, rtol=0)


def test_rloo_advantage_is_reward_minus_mean_of_others():
    # A, reward 1: others [1, 0, 1, 0] mean 0.5 -> 0.5; reward 0: others [1, 1, 1, 0] mean 0.75 -> -0.75
    torch.testing.assert_close(rloo_advantage(t(GROUP_A), 5), t([0.5, 0.5, -0.75, 0.5, -0.75]))
    # B, reward 1: others [0, 0, 0] mean 0 -> 1; reward 0: others [0, 1, 0] mean 1/3 -> -1/3
    torch.testing.assert_close(rloo_advantage(t(GROUP_B), 4), t([-1 / 3, -1 / 3, 1.0, -1 / 3]))


def test_dr_grpo_advantage_is_reward_minus_group_mean():
    # A: mean 0.6 -> [0.4, 0.4, -0.6, 0.4, -0.6]; B: mean 0.25 -> [-0.25, -0.25, 0.75, -0.25]
    torch.testing.assert_close(group_mean_advantage(t(GROUP_A), 5), t([0.4, 0.4, -0.6, 0.4, -0.6]))
    torch.testing.assert_close(group_mean_advantage(t(GROUP_B), 4), t([-0.25, -0.25, 0.75, -0.25]))


@pytest.mark.parametrize("rewards,g", [(GROUP_A, 5), (GROUP_B, 4)])
def test_each_group_advantage_sums_to_zero(rewards, g):
    for adv in (grpo_advantage(t(rewards), g, "sample"), grpo_advantage(t(rewards), g, "population"),
                rloo_advantage(t(rewards), g), group_mean_advantage(t(rewards), g)):
        assert abs(float(adv.sum())) < 1e-5


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "rloo", "dapo"])
def test_all_equal_group_gets_exact_zero(preset):
    # two groups of 3: [0.1, 0.1, 0.1] (mean of equal floats may round) and [1, 1, 1]; std 0 must not give NaN
    rewards = t([0.1, 0.1, 0.1, 1.0, 1.0, 1.0])
    cfg = AlgorithmConfig(preset=preset, kl={"beta": 0.0})  # rloo's preset puts a KL in the reward
    adv = compute_advantages(rewards, torch.ones(6, 2, dtype=torch.bool), 3, cfg)
    assert torch.equal(adv, torch.zeros(6, 2))


def test_grpo_single_sample_group_is_zero_not_nan():
    # G = 1: the sample std divides by G - 1 = 0; the group is all-equal, so exactly 0
    assert torch.equal(grpo_advantage(t([0.7, 0.2]), 1, "sample"), torch.zeros(2))


def test_zero_variance_groups_flags_groups_without_signal():
    # groups [1, 1] (no signal), [0, 1] (signal), [0.3, 0.3] (no signal)
    flags = zero_variance_groups(t([1, 1, 0, 1, 0.3, 0.3]), 2)
    assert flags.tolist() == [True, False, True]


def test_rloo_rejects_group_of_one():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantage(t([1.0, 0.0]), 1)


def test_group_size_must_divide_batch():
    with pytest.raises(ValueError, match="group_size=3"):
        group_mean_advantage(t([1.0, 0.0, 1.0, 0.0]), 3)


def test_advantages_broadcast_to_loss_tokens_only():
    # reinforce: A = R on every loss token, 0 elsewhere
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = compute_advantages(t([2.0, -1.0]), mask, 1, AlgorithmConfig(preset="reinforce"))
    assert torch.equal(adv, t([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_kl_in_reward_lowers_sequence_reward_before_grpo():
    # dr_grpo with kl in reward, beta 0.5: kl sums per sequence [0.4, 0.0] -> shaped rewards [1 - 0.2, 0] = [0.8, 0]
    # group mean 0.4 -> advantages [0.4, -0.4]
    cfg = AlgorithmConfig(preset="dr_grpo", kl={"beta": 0.5, "placement": "reward", "estimator": "k1"})
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = compute_advantages(t([1.0, 0.0]), mask, 2, cfg, kl=t([[0.1, 0.3], [0.0, 0.0]]))
    torch.testing.assert_close(adv, t([[0.4, 0.4], [-0.4, -0.4]]))


def test_kl_in_reward_without_kl_tensor_is_rejected():
    cfg = AlgorithmConfig(preset="ppo")
    with pytest.raises(ValueError, match="kl.placement=reward"):
        compute_advantages(t([1.0]), torch.ones(1, 2, dtype=torch.bool), 1, cfg, values=torch.zeros(1, 2))


def test_token_level_rewards_put_return_on_last_loss_token():
    # R = 1 at the last True position (index 1), -beta * kl = -0.1 * [1, 2] on loss tokens
    mask = torch.tensor([[True, True, False]])
    r = token_level_rewards(t([1.0]), mask, kl=t([[1.0, 2.0, 9.0]]), beta=0.1)
    torch.testing.assert_close(r, t([[-0.1, 0.8, 0.0]]))


def test_reinforce_pp_normalizes_over_batch_tokens():
    # one token per sequence, returns [1, 0]: mean 0.5, population std 0.5 -> [1, -1]
    adv = reinforce_pp_advantage(t([1.0, 0.0]), torch.ones(2, 1, dtype=torch.bool), 1)
    torch.testing.assert_close(adv, t([[1.0], [-1.0]]), atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_keeps_all_equal_group_at_zero():
    # groups [1, 0] -> [0.5, -0.5] and [1, 1] -> [0, 0]; token values [.5, -.5, 0, 0]: population std
    # sqrt((0.25 + 0.25) / 4) = 0.353553, no re-centring -> [1.414214, -1.414214, 0, 0]
    adv = reinforce_pp_advantage(t([1.0, 0.0, 1.0, 1.0]), torch.ones(4, 1, dtype=torch.bool), 2, group_baseline=True)
    torch.testing.assert_close(adv, t([[1.414214], [-1.414214], [0.0], [0.0]]), atol=1e-5, rtol=0)


def test_gae_with_lambda_one_is_return_minus_value():
    # gamma = lam = 1, reward 1 at the end: A_t = 1 - V_t = [0.5, 0.4, 0.3]
    adv, ret = gae_advantage(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)
    torch.testing.assert_close(adv, t([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0]]))


def test_gae_hand_computed_lambda_half():
    # deltas: d2 = 1 - 0.7 = 0.3, d1 = 0 + 0.7 - 0.6 = 0.1, d0 = 0.6 - 0.5 = 0.1
    # A2 = 0.3, A1 = 0.1 + 0.5 * 0.3 = 0.25, A0 = 0.1 + 0.5 * 0.25 = 0.225
    adv, _ = gae_advantage(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool), 1.0, 0.5)
    torch.testing.assert_close(adv, t([[0.225, 0.25, 0.3]]))


def test_gae_ignores_values_after_the_last_loss_token():
    # padding value 99 at t = 2 must not bootstrap: same as the unpadded [0.5, 0.4] with gamma = lam = 1
    mask = torch.tensor([[True, True, False]])
    adv, _ = gae_advantage(t([[0.0, 1.0, 0.0]]), t([[0.5, 0.6, 99.0]]), mask, 1.0, 1.0)
    torch.testing.assert_close(adv, t([[0.5, 0.4, 0.0]]))


def test_gae_through_compute_advantages_needs_values():
    cfg = AlgorithmConfig(preset="ppo", kl={"beta": 0.0})
    with pytest.raises(ValueError, match="needs the critic"):
        compute_advantages(t([1.0]), torch.ones(1, 2, dtype=torch.bool), 1, cfg)


def test_ppo_preset_whitens_gae_advantages():
    cfg = AlgorithmConfig(preset="ppo", kl={"beta": 0.0})
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = compute_advantages(t([1.0, 0.0]), mask, 1, cfg, values=torch.rand(2, 3))
    assert abs(float(adv.mean())) < 1e-5 and math.isclose(float(adv.std(unbiased=False)), 1.0, rel_tol=1e-3)
