"""KL estimators k1/k2/k3, KL placement, and the entropy of logits."""

import math

import pytest
import torch

from learner.aggregation import LossNormalizer
from learner.kl import entropy_from_logits, kl_estimate
from learner.objective import (
    PolicyLossInputs,
    compute_policy_loss,
    kl_for_reward,
    kl_in_reward,
    needs_ref_logprobs,
)
from protocols.algorithm import PRESETS, AlgorithmConfig

P = torch.tensor([0.5, 0.3, 0.2])  # current policy pi (samples come from it)
Q = torch.tensor([0.2, 0.3, 0.5])  # reference
# exact KL(P || Q) = 0.5 ln 2.5 + 0.3 ln 1 + 0.2 ln 0.4 = (0.5 - 0.2) * ln 2.5 = 0.274887
EXACT = 0.3 * math.log(2.5)


def test_k3_is_nonnegative_for_every_token():
    torch.manual_seed(0)
    lp, ref = -10 * torch.rand(64, 32), -10 * torch.rand(64, 32)
    assert bool((kl_estimate(lp, ref, "k3") >= 0).all())


@pytest.mark.parametrize("estimator,tol", [("k1", 0.03), ("k2", 0.10), ("k3", 0.03)])
def test_sample_mean_approaches_exact_kl(estimator, tol):
    # 200k samples from P; k1 and k3 are unbiased (3% covers ~5 standard errors), k2 is biased:
    # its mean is 0.5 * (0.5 + 0.2) * ln(2.5)^2 = 0.293864, 7% above the exact 0.274887
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(P, 200_000, replacement=True, generator=gen)
    est = kl_estimate(P.log()[x], Q.log()[x], estimator)
    assert float(est.mean()) == pytest.approx(EXACT, rel=tol)


def test_k1_and_k3_expectations_are_exact():
    # E_P[k3] = sum P (Q/P - 1) - sum P log(Q/P) = 0 + KL
    for estimator in ("k1", "k3"):
        expectation = float((P * kl_estimate(P.log(), Q.log(), estimator)).sum())
        assert expectation == pytest.approx(EXACT, rel=1e-5)


def test_k2_is_close_for_close_distributions():
    # P' = [0.4, 0.35, 0.25], Q' = [0.35, 0.4, 0.25]: KL = 0.05 ln(8/7) = 0.0066766, E[k2] = 0.0066866
    p, q = torch.tensor([0.4, 0.35, 0.25]), torch.tensor([0.35, 0.4, 0.25])
    assert float((p * kl_estimate(p.log(), q.log(), "k2")).sum()) == pytest.approx(0.05 * math.log(8 / 7), rel=0.01)


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="algorithm.kl.estimator='k4'"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_beta_zero_needs_no_reference_model():
    assert not needs_ref_logprobs(AlgorithmConfig(preset="dapo"))
    assert needs_ref_logprobs(AlgorithmConfig(preset="grpo"))  # beta 0.04, as DeepSeekMath
    assert not kl_in_reward(AlgorithmConfig(preset="grpo")) and kl_in_reward(AlgorithmConfig(preset="ppo"))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_beta_zero_runs_without_ref_logprobs(preset):
    cfg = AlgorithmConfig(preset=preset, kl={"beta": 0.0}, off_policy={"mode": "bypass"})
    inputs = PolicyLossInputs(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    loss, m = compute_policy_loss(torch.zeros(1, 2, requires_grad=True), inputs, cfg, LossNormalizer(2, 1, 2))
    assert torch.isfinite(loss) and "kl" not in m


def test_kl_in_loss_adds_beta_times_k3():
    # A = 0 so only the KL term: lp = 0, ref = ln 0.5 -> r = 0.5, k3 = 0.5 - 1 - ln 0.5 = 0.193147
    # token_mean over one token, beta 0.1 -> loss 0.0193147; d/d lp of beta * (e^(ref - lp) - 1 - (ref - lp))
    # = beta * (1 - r) = 0.05
    cfg = AlgorithmConfig(preset="dapo", kl={"beta": 0.1, "estimator": "k3", "placement": "loss"},
                          off_policy={"mode": "bypass"})
    lp = torch.zeros(1, 1, requires_grad=True)
    inputs = PolicyLossInputs(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool),
                              ref_logprobs=torch.full((1, 1), math.log(0.5)))
    loss, m = compute_policy_loss(lp, inputs, cfg, LossNormalizer(1, 1, 1))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(0.0193147, rel=1e-5) and float(lp.grad) == pytest.approx(0.05)
    assert m["kl"] == pytest.approx(0.193147, rel=1e-5)


def test_kl_for_reward_is_detached_and_masked():
    # k1 = lp - ref = [0.5, (masked)]
    cfg = AlgorithmConfig(preset="ppo")
    lp = torch.tensor([[-0.5, 1e4]], requires_grad=True)
    kl = kl_for_reward(lp, torch.tensor([[-1.0, -1e4]]), torch.tensor([[True, False]]), cfg)
    assert not kl.requires_grad and torch.equal(kl, torch.tensor([[0.5, 0.0]]))


def test_entropy_of_uniform_logits_is_log_vocab():
    assert torch.allclose(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))


def test_entropy_matches_categorical_and_chunking_changes_nothing():
    torch.manual_seed(0)
    logits = 3 * torch.randn(2, 5, 11)
    exact = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), exact)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=2), exact)


def test_entropy_gradient_through_chunked_checkpoint():
    torch.manual_seed(0)
    a = torch.randn(2, 5, 11, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    entropy_from_logits(a, chunk_size=2).sum().backward()
    torch.distributions.Categorical(logits=b).entropy().sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_entropy_bonus_lowers_loss_and_is_logged():
    # A = 0, entropy [1.0, 3.0], coef 0.1, token_mean: loss = -0.1 * (1 + 3) / 2 = -0.2; logged sum 4
    cfg = AlgorithmConfig(preset="dapo", entropy_coef=0.1, off_policy={"mode": "bypass"})
    inputs = PolicyLossInputs(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                              entropy=torch.tensor([[1.0, 3.0]]))
    loss, m = compute_policy_loss(torch.zeros(1, 2), inputs, cfg, LossNormalizer(2, 1, 2))
    assert float(loss.detach()) == pytest.approx(-0.2) and m["entropy"] == pytest.approx(4.0)


def test_entropy_bonus_without_grad_is_rejected():
    # entropy computed under no_grad would make the bonus a constant: refuse rather than silently ignore it
    cfg = AlgorithmConfig(preset="dapo", entropy_coef=0.1, off_policy={"mode": "bypass"})
    inputs = PolicyLossInputs(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
                              entropy=torch.ones(1, 2))
    with pytest.raises(ValueError, match="entropy computed with grad"):
        compute_policy_loss(torch.zeros(1, 2, requires_grad=True), inputs, cfg, LossNormalizer(2, 1, 2))
