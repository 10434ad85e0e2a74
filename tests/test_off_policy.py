"""Off-policy correction: decoupled vs bypass, TIS truncation, masking, weight statistics and ESS."""

import math

import pytest
import torch

from learner.aggregation import LossNormalizer, aggregate_loss
from learner.objective import PolicyLossInputs, compute_policy_loss, finalize_metrics, needs_proximal_logprobs
from learner.off_policy import behavior_weights, effective_sample_size
from learner.policy_losses import ppo_clip_loss
from protocols.algorithm import AlgorithmConfig

ALL = torch.ones(1, 3, dtype=torch.bool)
LOGW = torch.log(torch.tensor([[0.5, 1.5, 4.0]]))  # behavior weights pi_prox / mu = [0.5, 1.5, 4.0]


def test_tis_caps_weights_at_cap():
    # cap 2: [0.5, 1.5, 4.0] -> [0.5, 1.5, 2.0]; one token truncated
    w, keep, m = behavior_weights(LOGW, ALL, tis_cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0]]))
    assert keep.all() and m["is_truncated"] == 1.0 and m["is_weight_max"] == pytest.approx(4.0)


def test_token_mask_drops_tokens_outside_bounds():
    # keep 0.6 <= w <= 3: only the middle token (1.5) survives; dropped tokens get weight 0
    w, keep, m = behavior_weights(LOGW, ALL, tis_cap=None, mask_low=0.6, mask_high=3.0)
    assert keep.tolist() == [[False, True, False]] and m["is_masked"] == 2.0
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.5, 0.0]]))


def test_sequence_mask_uses_geometric_mean_weight():
    # seq 0: weights [0.5, 1.5, 4.0], geometric mean (3.0)^(1/3) = 1.442 -> kept under high bound 1.5
    # seq 1: weights [2, 2, 2], geometric mean 2 -> masked whole
    logw = torch.cat([LOGW, torch.log(torch.full((1, 3), 2.0))])
    _, keep, m = behavior_weights(logw, torch.ones(2, 3, dtype=torch.bool), tis_cap=None, mask_high=1.5,
                                  mask_level="sequence")
    assert keep.tolist() == [[True] * 3, [False] * 3] and m["is_masked"] == 3.0


def test_ess_of_weights():
    # w = [1, 2, 1, 0.5]: (sum w)^2 / (N sum w^2) = 4.5^2 / (4 * 6.25) = 20.25 / 25 = 0.81
    w = torch.tensor([[1.0, 2.0, 1.0, 0.5]])
    assert effective_sample_size(w, torch.ones(1, 4, dtype=torch.bool)) == pytest.approx(0.81)
    _, _, m = behavior_weights(torch.log(w), torch.ones(1, 4, dtype=torch.bool))
    out = finalize_metrics({**m, "num_tokens": 4.0})
    assert out["is_ess"] == pytest.approx(0.81) and out["is_weight_mean"] == pytest.approx(4.5 / 4)
    assert out["is_weight_max"] == pytest.approx(2.0) and out["is_truncated_frac"] == 0.0


def test_decoupled_with_proximal_equal_behavior_is_plain_ppo():
    torch.manual_seed(0)
    mu, adv = -torch.rand(2, 3), torch.randn(2, 3)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    lp = (mu + 0.3 * torch.randn(2, 3)).requires_grad_()
    norm = LossNormalizer(5, 2, 3)
    cfg = AlgorithmConfig(preset="grpo", kl={"beta": 0.0})  # decoupled + TIS cap 2 by default
    loss, _ = compute_policy_loss(lp, PolicyLossInputs(mu, adv, mask, proximal_logprobs=mu.clone()), cfg, norm)
    (grad,) = torch.autograd.grad(loss, lp)
    lp2 = lp.detach().clone().requires_grad_()
    per_token, _ = ppo_clip_loss(lp2, mu, adv, mask, 0.2, 0.2)
    ref = aggregate_loss(per_token, mask, "seq_mean_token_mean", norm)
    (ref_grad,) = torch.autograd.grad(ref, lp2)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_decoupled_clips_against_proximal_not_behavior():
    # mu = log 1.5 below prox = 0 would make pi/mu = 1 (inside); pi/prox = 1.5 with A = 1 is clipped -> no gradient
    lp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    cfg = AlgorithmConfig(preset="dapo", off_policy={"tis_cap": None})
    inputs = PolicyLossInputs(torch.tensor([[math.log(1.5)]]), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
                              proximal_logprobs=torch.zeros(1, 1))
    loss, _ = compute_policy_loss(lp, inputs, cfg, LossNormalizer(1, 1, 1))
    loss.backward()
    assert float(lp.grad) == 0.0


def test_decoupled_weights_token_loss_by_proximal_over_behavior():
    # reinforce loss, prox - mu = log 1.5: loss = -1.5 * A * lp, gradient -1.5 * A = -3 with A = 2
    lp = torch.tensor([[-1.0]], requires_grad=True)
    cfg = AlgorithmConfig(preset="reinforce")
    inputs = PolicyLossInputs(torch.tensor([[-1.0 - math.log(1.5)]]), torch.full((1, 1), 2.0),
                              torch.ones(1, 1, dtype=torch.bool), proximal_logprobs=torch.tensor([[-1.0]]))
    loss, m = compute_policy_loss(lp, inputs, cfg, LossNormalizer(1, 1, 1))
    loss.backward()
    assert float(lp.grad) == pytest.approx(-3.0) and m["is_weight"] == pytest.approx(1.5)


def test_decoupled_tis_cap_bounds_the_weight_in_the_loss():
    # prox/mu = 4 capped at 2: reinforce gradient -2 * A = -2 with A = 1
    lp = torch.tensor([[0.0]], requires_grad=True)
    inputs = PolicyLossInputs(torch.tensor([[-math.log(4.0)]]), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
                              proximal_logprobs=torch.zeros(1, 1))
    loss, m = compute_policy_loss(lp, inputs, AlgorithmConfig(preset="reinforce"), LossNormalizer(1, 1, 1))
    loss.backward()
    assert float(lp.grad) == pytest.approx(-2.0) and m["is_truncated"] == 1.0


def test_bypass_uses_behavior_as_old_policy_without_recompute():
    # mu = log(1/1.5): pi/mu = 1.5 with A = 1 -> clipped, gradient 0; no proximal needed
    cfg = AlgorithmConfig(preset="grpo", kl={"beta": 0.0}, off_policy={"mode": "bypass"})
    assert not needs_proximal_logprobs(cfg)
    lp = torch.tensor([[0.0]], requires_grad=True)
    inputs = PolicyLossInputs(torch.tensor([[-math.log(1.5)]]), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    loss, m = compute_policy_loss(lp, inputs, cfg, LossNormalizer(1, 1, 1))
    loss.backward()
    assert float(lp.grad) == 0.0 and m["clip_frac"] == 1.0 and float(loss.detach()) == pytest.approx(-1.2)


def test_bypass_reinforce_uses_truncated_current_over_behavior_weight():
    # pi/mu = 3, capped at 2, detached: loss -2 * A * lp -> gradient -2 with A = 1
    cfg = AlgorithmConfig(preset="reinforce", off_policy={"mode": "bypass"})
    lp = torch.tensor([[math.log(3.0)]], requires_grad=True)
    inputs = PolicyLossInputs(torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    loss, _ = compute_policy_loss(lp, inputs, cfg, LossNormalizer(1, 1, 1))
    loss.backward()
    assert float(lp.grad) == pytest.approx(-2.0)


def test_decoupled_without_proximal_is_rejected():
    inputs = PolicyLossInputs(torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="mode=decoupled needs PolicyLossInputs.proximal_logprobs"):
        compute_policy_loss(torch.zeros(1, 1), inputs, AlgorithmConfig(preset="dapo"), LossNormalizer(1, 1, 1))
