"""Token-budget micro-batches and packing on real DeepSpeed ranks: the same two steps give the same losses,
gradient norms and weights as one big padded micro-batch per step on one rank, whatever the split."""

import pytest
import ray
import torch

from learner.objective import count_normalizer
from protocols.config import load_config
from protocols.training_batch import TrainingBatch
from tests.conftest import at_once

pytestmark = pytest.mark.slow


def make_batch(num_samples: int, max_len: int, seed: int) -> TrainingBatch:
    # Ragged lengths (1 .. max_len) so micro-batches hold different token counts and token_mean needs the
    # global normalizer.
    g = torch.Generator().manual_seed(seed)
    prompts, responses, behavior, advantages = [], [], [], []
    for i in range(num_samples):
        length = 1 + int(torch.randint(0, max_len, (1,), generator=g))
        prompts.append([1, 3 + i % 10, 13, 3 + (i * 7) % 10, 14][: 2 + i % 4])
        responses.append(torch.randint(3, 13, (length,), generator=g).tolist())
        behavior.append((-2.5 + 0.1 * torch.randn(length, generator=g)).tolist())
        advantages.append([1.0 if i % 2 else -1.0] * length)
    # one masked sample: it counts in no normalizer
    return TrainingBatch.from_samples(prompts, responses, behavior, advantages=advantages,
                                      sample_mask=[i != 5 for i in range(num_samples)])


def normalizer(batch: TrainingBatch):
    return count_normalizer(batch.loss_mask, 16)


def run_two_steps(model_path: str, overrides: list[str]) -> tuple[list[dict], dict]:
    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, ["learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "learner.lr=1e-3",
                             "algorithm.preset=dapo", "rollout.max_response_tokens=16",
                             "algorithm.entropy_coef=0.01", *overrides])
    group = LearnerGroup(cfg, model_path)
    try:
        # step 2's longer responses need more micro-batches than step 1's: the accumulation boundary must follow
        metrics = [group.train_step(b, normalizer(b)) for b in (make_batch(8, 4, 0), make_batch(8, 14, 1))]
        logprobs = group.policy_logprobs(make_batch(8, 6, 2))
        packed = ray.get(group.publish_weights().refs[0])
    finally:
        group.shutdown()
    weights = {k: torch.from_numpy(v.copy()) for k, (_, v) in packed.items()}
    return metrics, {"weights": weights, "logprobs": logprobs}


def test_token_budget_and_packing_match_one_big_micro_batch(ray_cluster, tiny_models):
    path = tiny_models["tied"]
    variants = {
        "budget 1 rank": ["learner.max_tokens_per_micro_batch=12"],
        "budget 2 ranks zero2 packed": ["learner.num_ranks=2", "learner.max_tokens_per_micro_batch=12",
                                        "learner.packing=true", "learner.logits_chunk_tokens=5"],
        "budget 2 ranks zero3 packed": ["learner.num_ranks=2", "learner.zero_stage=3", "learner.packing=true",
                                        "learner.max_tokens_per_micro_batch=12", "learner.logits_chunk_tokens=5"],
    }
    # the four groups (6 rank processes) run at once
    (base, base_out), *runs = at_once((run_two_steps, path, ["learner.micro_batch_size=8",
                                                             "learner.logits_chunk_tokens=0"]),
                                      *[(run_two_steps, path, overrides) for overrides in variants.values()])
    assert [m["learner/micro_batches_max"] for m in base] == [1, 1]
    for name, (metrics, out) in zip(variants, runs):
        # 8 samples of 3 to 19 tokens at a budget of 12: several micro-batches, more in step 2 than in step 1
        counts = [m["learner/micro_batches_max"] for m in metrics]
        assert 1 < counts[0] < counts[1], (name, counts)
        for step, (got, want) in enumerate(zip(metrics, base)):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), (name, step)
            assert got["grad_norm_max"] == pytest.approx(want["grad_norm_max"], rel=1e-4), (name, step)
            assert got["num_tokens"] == want["num_tokens"], (name, step)
        if "packed" in name:  # no padding at all in a packed row
            assert all(m["learner/effective_token_frac"] == 1.0 for m in metrics), name
        # Two Adam steps of lr 1e-3; as in test_learner_sharding, 2% of a step absorbs float noise in the sign
        # of near-zero gradients, while a wrong normalizer or boundary would be off by whole steps.
        for key, tensor in base_out["weights"].items():
            torch.testing.assert_close(out["weights"][key], tensor, rtol=0, atol=4e-5, msg=f"{name} {key}")
        flat = lambda rows: torch.tensor([x for row in rows for x in row])  # noqa: E731
        torch.testing.assert_close(flat(out["logprobs"]), flat(base_out["logprobs"]), rtol=0, atol=1e-4)
    assert base[0]["learner/effective_token_frac"] < 1.0  # one padded micro-batch of ragged samples
