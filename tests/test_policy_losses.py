"""Policy losses: which term the min picks, where the gradient vanishes, GSPO/CISPO specifics, masking safety."""

import math

import pytest
import torch

from learner.aggregation import LossNormalizer
from learner.objective import PolicyLossInputs, compute_policy_loss
from learner.policy_losses import cispo_loss, gspo_loss, ppo_clip_loss, reinforce_loss, sequence_log_ratio
from protocols.algorithm import PRESETS, AlgorithmConfig


def ppo_token(ratio, adv, **kw):
    """Loss and d loss / d logprobs of one token with old log-prob 0 and log-prob log(ratio)."""
    lp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, _ = ppo_clip_loss(lp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1, dtype=torch.bool), **kw)
    loss.sum().backward()
    return float(loss.detach()), float(lp.grad)


def test_ppo_positive_advantage_ratio_above_band_picks_clipped_term_and_zero_grad():
    # A = 1, r = 1.5: r A = 1.5, clip(r) A = 1.2 -> min is the clipped 1.2, constant in theta
    loss, grad = ppo_token(1.5, 1.0)
    assert loss == pytest.approx(-1.2) and grad == 0.0


def test_ppo_positive_advantage_ratio_below_band_picks_unclipped_term():
    # A = 1, r = 0.5: r A = 0.5 < clip(r) A = 0.8 -> unclipped; d(-r A)/d log pi = -r A = -0.5
    loss, grad = ppo_token(0.5, 1.0)
    assert loss == pytest.approx(-0.5) and grad == pytest.approx(-0.5)


def test_ppo_negative_advantage_ratio_below_band_picks_clipped_term_and_zero_grad():
    # A = -1, r = 0.5: r A = -0.5, clip(r) A = -0.8 -> min is the clipped -0.8; loss 0.8, no gradient
    loss, grad = ppo_token(0.5, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0


def test_ppo_negative_advantage_ratio_above_band_picks_unclipped_term():
    # A = -1, r = 1.5: r A = -1.5 < clip(r) A = -1.2 -> unclipped; loss 1.5, gradient -r A = 1.5
    loss, grad = ppo_token(1.5, -1.0)
    assert loss == pytest.approx(1.5) and grad == pytest.approx(1.5)


def test_ppo_ratio_inside_band_is_plain_surrogate():
    # A = 1, r = 1.1 inside [0.8, 1.2]: both terms 1.1; gradient -1.1
    loss, grad = ppo_token(1.1, 1.0)
    assert loss == pytest.approx(-1.1) and grad == pytest.approx(-1.1)


def test_dual_clip_bounds_negative_advantage_loss_at_c():
    # A = -1, r = 5, c = 3: unclipped loss 5 > -c A = 3 -> loss 3, constant, no gradient
    loss, grad = ppo_token(5.0, -1.0, dual_clip_c=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0


def test_clip_higher_uses_separate_upper_bound():
    # eps_low 0.2, eps_high 0.28: r = 1.25 is inside (gradient -1.25); r = 1.3 is clipped at 1.28
    assert ppo_token(1.25, 1.0, eps_high=0.28)[1] == pytest.approx(-1.25)
    loss, grad = ppo_token(1.3, 1.0, eps_high=0.28)
    assert loss == pytest.approx(-1.28) and grad == 0.0


def test_ppo_clip_metrics_count_clipped_tokens():
    # tokens: (r 1.5, A 1) clipped high, (r 0.5, A -1) clipped low, (r 1.0, A 1) not clipped
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    _, m = ppo_clip_loss(lp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool))
    assert (m["clip_frac"], m["clip_frac_high"], m["clip_frac_low"]) == (2.0, 1.0, 1.0)
    assert m["ratio"] == pytest.approx(3.0) and m["ratio_max"] == pytest.approx(1.5)


def test_gspo_sequence_ratio_is_exp_of_mean_unmasked_log_ratio():
    # log-ratios [0.1, 0.3, (masked 5.0)] -> mean 0.2 -> s = exp(0.2) = 1.221403
    lp = torch.tensor([[0.1, 0.3, 5.0]])
    mask = torch.tensor([[True, True, False]])
    assert float(torch.exp(sequence_log_ratio(lp, torch.zeros(1, 3), mask))) == pytest.approx(math.exp(0.2))


def test_gspo_gradient_spreads_the_sequence_ratio_over_its_tokens():
    # wide band: loss per token -s A with s = exp(mean log-ratio); d(-s)/d lp_t = -s / |y| = -1.221403 / 2
    lp = torch.tensor([[0.1, 0.3, 5.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, _ = gspo_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), mask, eps_low=0.5, eps_high=0.5)
    assert float(loss[0, 0].detach()) == pytest.approx(-math.exp(0.2))
    loss[0, 0].backward()  # one token's loss value already depends on every token of the sequence
    torch.testing.assert_close(lp.grad, torch.tensor([[-math.exp(0.2) / 2, -math.exp(0.2) / 2, 0.0]]))


def test_gspo_clipped_sequence_gets_no_gradient_on_any_token():
    # seq 0: s = exp(0.2) > 1 + 4e-4 with A = 1 -> clipped, all its grads 0; seq 1: s = 1 -> inside, grads != 0
    lp = torch.tensor([[0.1, 0.3], [0.0, 0.0]], requires_grad=True)
    cfg = AlgorithmConfig(preset="gspo", off_policy={"mode": "bypass"})
    inputs = PolicyLossInputs(torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool))
    loss, m = compute_policy_loss(lp, inputs, cfg, LossNormalizer(4, 2, 8))
    loss.backward()
    assert torch.equal(lp.grad[0], torch.zeros(2)) and bool((lp.grad[1] != 0).all())
    assert m["clip_frac"] == 2.0  # the two tokens of the clipped sequence


def test_gspo_preset_value_matches_paper_objective():
    # seq_mean_token_mean: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i); s = [exp(0.2) clipped to 1.0004, 1], A = 1
    lp = torch.tensor([[0.1, 0.3], [0.0, 0.0]], requires_grad=True)
    cfg = AlgorithmConfig(preset="gspo", off_policy={"mode": "bypass"})
    inputs = PolicyLossInputs(torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool))
    loss, _ = compute_policy_loss(lp, inputs, cfg, LossNormalizer(4, 2, 8))
    assert float(loss.detach()) == pytest.approx(-(1.0004 + 1.0) / 2)


def test_cispo_token_far_outside_band_keeps_gradient():
    # r = e^2 = 7.39 with A = 1: PPO clips it (grad 0), CISPO weights it by clip(r) = 1 + eps_high = 2 -> grad -2
    lp = torch.tensor([[2.0]], requires_grad=True)
    loss, m = cispo_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    loss.sum().backward()
    assert float(lp.grad) == pytest.approx(-2.0) and m["clip_frac"] == 1.0
    assert ppo_token(math.exp(2.0), 1.0)[1] == 0.0


def test_cispo_weight_is_not_differentiated():
    # inside the band the weight is r = e^0.1 but detached: d(-w A lp)/d lp = -w A = -1.105171 (PPO would give -r A
    # too; the difference shows as the loss value -w A lp, not -r A)
    lp = torch.tensor([[0.1]], requires_grad=True)
    loss, _ = cispo_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool))
    loss.sum().backward()
    assert float(lp.grad) == pytest.approx(-math.exp(0.1))
    assert float(loss.detach()) == pytest.approx(-math.exp(0.1) * 0.1)


def test_reinforce_gradient_is_minus_advantage():
    # loss = -A log pi -> gradient -A = [-2, 0.5]
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = reinforce_loss(lp, lp.detach(), torch.tensor([[2.0, -0.5]]), torch.ones(1, 2, dtype=torch.bool))
    loss.sum().backward()
    assert torch.equal(lp.grad, torch.tensor([[-2.0, 0.5]]))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("fill", [1e4, -1e4])
def test_masked_positions_change_neither_loss_nor_gradient(preset, fill):
    torch.manual_seed(0)
    cfg = AlgorithmConfig(preset=preset, kl={"beta": 0.1, "placement": "loss"}, entropy_coef=0.01,
                          off_policy={"mask_low": 0.5, "mask_high": 3.0})
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    base = {k: -torch.rand(2, 4) for k in ("lp", "mu", "prox", "ref")}
    base["adv"], base["ent"] = torch.randn(2, 4), torch.rand(2, 4)
    norm = LossNormalizer(4, 2, 4)

    def run(filled: bool):
        d = {k: torch.where(mask, v, torch.tensor(fill)) if filled else v.clone() for k, v in base.items()}
        lp = d["lp"].requires_grad_()
        ent = d["ent"].requires_grad_()
        inputs = PolicyLossInputs(d["mu"], d["adv"], mask, proximal_logprobs=d["prox"],
                                  ref_logprobs=d["ref"], entropy=ent)
        loss, _ = compute_policy_loss(lp, inputs, cfg, norm)
        loss.backward()
        return loss.detach(), lp.grad, ent.grad

    for a, b in zip(run(False), run(True)):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)


def test_gspo_on_a_packed_row_with_sequence_mean_matches_one_row_per_sequence():
    # Two sequences of 3 and 2 tokens as rows, then packed into one row [a a a b b]: with a sequence_mean that
    # averages each sample's own columns, loss and gradient per token are those of the unpacked rows.
    lp_rows = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], requires_grad=True)
    old_rows = torch.tensor([[-1.1, -1.9, -0.5], [-0.2, -1.0, 0.0]])
    adv_rows = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    mask_rows = torch.tensor([[True, True, True], [True, True, False]])
    loss_rows, _ = gspo_loss(lp_rows, old_rows, adv_rows, mask_rows, eps_low=0.2, eps_high=0.2)
    loss_rows[mask_rows].sum().backward()

    lp_row = lp_rows.detach()[mask_rows][None].clone().requires_grad_(True)
    sample = torch.tensor([0, 0, 0, 1, 1])

    def sequence_mean(values):  # per-sample mean over its columns, back on the columns
        sums = torch.zeros(2).index_add(0, sample, values[0])
        return (sums / torch.tensor([3.0, 2.0]))[sample][None]

    loss_row, _ = gspo_loss(lp_row, old_rows[mask_rows][None], adv_rows[mask_rows][None],
                            torch.ones(1, 5, dtype=torch.bool), eps_low=0.2, eps_high=0.2,
                            sequence_mean=sequence_mean)
    loss_row.sum().backward()
    torch.testing.assert_close(loss_row[0], loss_rows.detach()[mask_rows])
    torch.testing.assert_close(lp_row.grad[0], lp_rows.grad[mask_rows])
