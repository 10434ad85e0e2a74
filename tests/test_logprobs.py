"""Chunked LM-head scoring: the same log-probs, entropies and gradients as materialized logits, in any chunking."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.batch import collate, collate_packed, response_logits, score_responses, token_logprobs
from protocols.training_batch import TrainingBatch
from learner.kl import entropy_from_logits
from learner.logprobs import chunked_logprobs_entropy


def full_path(hidden, weight, bias, targets, temperature):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    logits = logits.float() / temperature
    return token_logprobs(logits[None], targets[None])[0], entropy_from_logits(logits[None])[0]


@pytest.mark.parametrize("chunk", [1, 4, 7, 13, 100])  # 13 positions: chunks that do and do not divide N
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_scores_and_gradients_equal_full_logits(chunk, with_bias):
    g = torch.Generator().manual_seed(0)
    n, h, v, temperature = 13, 8, 11, 0.7
    # logits of order 1, as a trained LM head gives
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (0.4 * torch.randn(v, h, generator=g)).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_() if with_bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    # an arbitrary weighted sum of both outputs checks both gradient paths at once
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    lp, ent = chunked_logprobs_entropy(hidden, weight, targets, bias=bias, temperature=temperature,
                                       chunk_tokens=chunk)
    grads = torch.autograd.grad((lp * w_lp + ent * w_ent).sum(), [hidden, weight] + ([bias] if with_bias else []))
    lp_ref, ent_ref = full_path(hidden, weight, bias, targets, temperature)
    grads_ref = torch.autograd.grad((lp_ref * w_lp + ent_ref * w_ent).sum(),
                                    [hidden, weight] + ([bias] if with_bias else []))
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_entropy_of_uniform_logits_is_log_vocab():
    # zero weights: every logit 0, so p is uniform over V = 6 and H = log 6; log-prob of any token = -log 6
    lp, ent = chunked_logprobs_entropy(torch.randn(3, 4), torch.zeros(6, 4), torch.tensor([0, 3, 5]), chunk_tokens=2)
    torch.testing.assert_close(ent, torch.full((3,), torch.log(torch.tensor(6.0)).item()))
    torch.testing.assert_close(lp, -ent)


def test_only_logprob_gradient_when_entropy_unused():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, generator=g).requires_grad_()
    weight = torch.randn(9, 4, generator=g)
    targets = torch.randint(0, 9, (5,), generator=g)
    lp, _ = chunked_logprobs_entropy(hidden, weight, targets, chunk_tokens=2)
    (grad,) = torch.autograd.grad(lp.sum(), hidden)
    lp_ref, _ = full_path(hidden, weight, None, targets, 1.0)
    (grad_ref,) = torch.autograd.grad(lp_ref.sum(), hidden)
    torch.testing.assert_close(grad, grad_ref, rtol=0, atol=1e-5)


def tiny_model(tied: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=20, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
RESPONSES = [[10, 11], [12], [13, 14, 15, 16, 17]]


def model_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_model_scores_match_the_full_logits_path(tied, packed):
    # Reference: today's path, padded rows, (B, T, V) logits. Candidate: chunked head (3 positions per chunk over
    # 8 response tokens), padded or packed. Same log-probs, entropies and parameter gradients, tied head included.
    model = tiny_model(tied)
    padded = collate(TrainingBatch.from_samples(PROMPTS, RESPONSES), pad_id=0)
    logits = response_logits(model, padded, temperature=0.8)
    lp_ref = torch.where(padded.score_mask, token_logprobs(logits, padded.response_ids), 0.0)
    ent_ref = torch.where(padded.score_mask, entropy_from_logits(logits), 0.0)
    grads_ref = model_grads(model, lp_ref.sum() + 0.3 * ent_ref.sum())

    batch = (collate_packed if packed else collate)(TrainingBatch.from_samples(PROMPTS, RESPONSES), pad_id=0)
    lp, ent = score_responses(model, batch, temperature=0.8, chunk_tokens=3)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-5)
    grads = model_grads(model, lp.sum() + 0.3 * ent.sum())
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=0, atol=1e-5, msg=name)
    assert model.get_output_embeddings().forward.__func__ is type(model.get_output_embeddings()).forward


def test_packed_row_has_no_padding_and_restarts_positions():
    batch = collate_packed(TrainingBatch.from_samples(PROMPTS, RESPONSES), pad_id=0)
    # lengths 3+2, 5+1, 1+5 -> one row of 17 tokens
    assert batch.input_ids.shape == (1, 17)
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    # sample 1's response token sits at 5 + 5 = 10, predicted by output 9
    assert batch.score_index[1, 0].item() == 9
    assert batch.attention_mask is None


def test_full_logits_path_of_score_responses_equals_response_logits():
    model = tiny_model(False).eval()
    batch = collate(TrainingBatch.from_samples(PROMPTS, RESPONSES), pad_id=0)
    with torch.no_grad():
        lp, _ = score_responses(model, batch, temperature=1.0, chunk_tokens=0)
        ref = token_logprobs(response_logits(model, batch, 1.0), batch.response_ids)
    torch.testing.assert_close(lp, torch.where(batch.score_mask, ref, 0.0), rtol=0, atol=1e-6)
