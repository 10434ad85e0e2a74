"""Loss aggregation modes and their exactness under data-parallel sharding and gradient accumulation."""

import pytest
import torch

from learner.aggregation import LossNormalizer, aggregate_loss, count_normalizer
from learner.objective import PolicyLossInputs, combine_metrics, compute_policy_loss, finalize_metrics
from protocols.algorithm import PRESETS, AlgorithmConfig

# two sequences: token losses [1, 2, 3] (3 tokens) and [4, (masked)] (1 token)
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 0.0]])
MASK = torch.tensor([[True, True, True], [True, False, False]])
NORM = LossNormalizer(global_num_tokens=4, global_num_sequences=2, max_response_tokens=10)


def test_token_mean_divides_by_global_tokens():
    # (1 + 2 + 3 + 4) / 4 = 2.5
    assert float(aggregate_loss(LOSS, MASK, "token_mean", NORM)) == pytest.approx(2.5)


def test_seq_mean_token_mean_averages_per_sequence_first():
    # (6 / 3 + 4 / 1) / 2 = (2 + 4) / 2 = 3
    assert float(aggregate_loss(LOSS, MASK, "seq_mean_token_mean", NORM)) == pytest.approx(3.0)


def test_seq_mean_token_sum_norm_divides_by_constant():
    # (6 / 10 + 4 / 10) / 2 = 0.5
    assert float(aggregate_loss(LOSS, MASK, "seq_mean_token_sum_norm", NORM)) == pytest.approx(0.5)


def test_count_normalizer_skips_fully_masked_sequences():
    # rows with 3, 1 and 0 loss tokens: 4 tokens, 2 sequences
    n = count_normalizer(torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)]), 10)
    assert (n.global_num_tokens, n.global_num_sequences, n.max_response_tokens) == (4.0, 2.0, 10)


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match="algorithm.aggregation='mean'"):
        aggregate_loss(LOSS, MASK, "mean", NORM)


def _global_batch():
    g = torch.Generator().manual_seed(0)
    n, t = 8, 5
    lengths = torch.tensor([5, 1, 3, 4, 2, 5, 0, 3])  # one fully masked sample (e.g. a masked truncated one)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mu = -torch.rand(n, t, generator=g)
    return {
        "lp": mu + 0.2 * torch.randn(n, t, generator=g),
        "mu": mu,
        "prox": mu + 0.1 * torch.randn(n, t, generator=g),
        "ref": -torch.rand(n, t, generator=g),
        "adv": torch.randn(n, t, generator=g),
        "ent": torch.rand(n, t, generator=g),
        "mask": mask,
    }


def _sharded_loss_and_grad(cfg, batch, num_shards, micro_per_shard):
    norm = count_normalizer(batch["mask"], max_response_tokens=5)
    lp = batch["lp"].clone().requires_grad_()
    ent = batch["ent"].clone().requires_grad_()
    total, parts = 0.0, []
    n = lp.shape[0]
    chunk = n // (num_shards * micro_per_shard)
    for start in range(0, n, chunk):  # rank r holds chunks [r*m, (r+1)*m): same rows either way
        rows = slice(start, start + chunk)
        inputs = PolicyLossInputs(batch["mu"][rows], batch["adv"][rows], batch["mask"][rows],
                                  proximal_logprobs=batch["prox"][rows], ref_logprobs=batch["ref"][rows],
                                  entropy=ent[rows])
        loss, metrics = compute_policy_loss(lp[rows], inputs, cfg, norm)
        loss.backward()  # gradient accumulation: grads of every micro-batch add up
        total += float(loss.detach())
        parts.append(metrics)
    return total, lp.grad.clone(), ent.grad.clone(), finalize_metrics(combine_metrics(parts))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sum_over_shards_and_micro_batches_equals_global_loss(preset, aggregation):
    cfg = AlgorithmConfig(preset=preset, aggregation=aggregation, kl={"beta": 0.05}, entropy_coef=0.01)
    batch = _global_batch()
    ref_loss, ref_grad, ref_ent_grad, ref_metrics = _sharded_loss_and_grad(cfg, batch, 1, 1)
    for shards, micro in [(2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]:
        loss, grad, ent_grad, metrics = _sharded_loss_and_grad(cfg, batch, shards, micro)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
        torch.testing.assert_close(grad, ref_grad)
        torch.testing.assert_close(ent_grad, ref_ent_grad)
        assert metrics == pytest.approx(ref_metrics, rel=1e-5, abs=1e-7)


def test_seq_mean_token_mean_with_sequence_lengths_is_exact_on_slices_of_a_packed_row():
    # LOSS's two sequences packed in one row [1, 2, 3 | 4], cut into slices [1, 2] and [3, 4] as two SP ranks
    # hold it: the row's own mask would count one sequence of 2 tokens per slice; |y| = 3, 3 | 3, 1 per column
    # gives (1 + 2) / 3 + (3 / 3 + 4 / 1) = 1 + 5 = 6, over 2 sequences = 3, the unsplit value above.
    slices = [(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 3.0]])),
              (torch.tensor([[3.0, 4.0]]), torch.tensor([[3.0, 1.0]]))]
    mask = torch.ones(1, 2, dtype=torch.bool)
    shares = [float(aggregate_loss(loss, mask, "seq_mean_token_mean", NORM, lengths)) for loss, lengths in slices]
    assert shares == pytest.approx([0.5, 2.5])
    assert sum(shares) == pytest.approx(float(aggregate_loss(LOSS, MASK, "seq_mean_token_mean", NORM)))
    # token_mean and Dr.GRPO ignore the lengths: sums over tokens over global constants
    for mode in ("token_mean", "seq_mean_token_sum_norm"):
        split = sum(float(aggregate_loss(loss, mask, mode, NORM, lengths)) for loss, lengths in slices)
        assert split == pytest.approx(float(aggregate_loss(LOSS, MASK, mode, NORM))), mode
