"""Batching: padded rows score every response token exactly as the same sequence scored alone."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.batch import collate, pad_per_token, response_logits, token_logprobs
from protocols.training_batch import TrainingBatch


def tiny_model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=20, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


def alone(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    # token k of the response is predicted at position len(prompt) + k - 1
    return torch.stack([logp[len(prompt) + k - 1, t] for k, t in enumerate(response)])


def test_left_and_right_padding_change_no_logprob():
    model = tiny_model()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    responses = [[10, 11], [12], [13, 14, 15, 16]]
    batch = collate(TrainingBatch.from_samples(prompts, responses), pad_id=0)
    assert batch.input_ids.shape == (3, 5 + 4)  # widest prompt 5 + widest response 4
    with torch.no_grad():
        logprobs = token_logprobs(response_logits(model, batch, temperature=1.0), batch.response_ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        torch.testing.assert_close(logprobs[i, : len(r)], alone(model, p, r), rtol=1e-5, atol=1e-5)
    assert batch.score_mask.tolist() == [[True, True, False, False], [True, False, False, False], [True] * 4]


def test_temperature_divides_the_logits():
    # log-probs at temperature 2 are log_softmax(logits / 2)
    model = tiny_model()
    batch = collate(TrainingBatch.from_samples([[1, 2]], [[3, 4]]), pad_id=0)
    with torch.no_grad():
        hot = response_logits(model, batch, temperature=2.0)
        cold = response_logits(model, batch, temperature=1.0)
    torch.testing.assert_close(hot * 2.0, cold)


def test_token_logprobs_equals_log_softmax_gather():
    logits = torch.randn(2, 3, 7)
    ids = torch.tensor([[0, 6, 3], [2, 2, 5]])
    expected = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids), expected)


def test_pad_per_token_zero_fills():
    assert pad_per_token([[1.0], [2.0, 3.0]], 3).tolist() == [[1.0, 0.0, 0.0], [2.0, 3.0, 0.0]]


def test_padding_reads_values_as_torch_tensor_would_also_where_the_fast_path_cannot():
    from protocols.training_batch import _pad

    # integers and bools through the array path; a float among integers and an integer past 64 bits through
    # torch.tensor's (truncated, and rounded to float32), as before
    assert _pad([[1, True, 3], []], 4, torch.long, fill=-1).tolist() == [[1, 1, 3, -1], [-1, -1, -1, -1]]
    assert _pad([[1.5, 2]], 2, torch.long).tolist() == [[1, 2]]
    assert _pad([[2**70, -1e300, -0.5]], 4, torch.float32).tolist() == [[2.0**70, float("-inf"), -0.5, 0.0]]
    assert _pad([[0, 2, True], [False]], 3, torch.bool).tolist() == [[False, True, True], [False, False, False]]
