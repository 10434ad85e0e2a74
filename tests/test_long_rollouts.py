"""Long responses through the real stack (vLLM, Ray, DeepSpeed) with partial rollouts: a few steps of
thousands of tokens per sample complete, truncated samples meet the overlong shaping, and the learner's peak
memory at a fixed token budget does not follow the response length."""

import time
from pathlib import Path

import pytest
import ray
import torch

from protocols.config import load_config
from protocols.training_batch import TrainingBatch

pytestmark = pytest.mark.slow

MAX_RESPONSE = 2500
BUDGET = 4096


def build_talkative_model(folder: Path) -> str:
    """A random demo model with an 8,192-token context that almost never ends a response: the EOS row of the
    (untied) head is zero and every other row is scaled up, so some other logit nearly always dwarfs EOS's 0
    (all 14 others negative at once has probability 2^-14 per token)."""
    from transformers import AutoModelForCausalLM

    from demos.arithmetic_model import build_random_model

    path = build_random_model(folder, tied=False, max_positions=8192, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
        model.lm_head.weight[model.config.eos_token_id] = 0.0
    model.save_pretrained(path)
    return path


def synthetic_batch(num_samples: int, response_len: int) -> TrainingBatch:
    g = torch.Generator().manual_seed(response_len)
    return TrainingBatch.from_samples(
        [[1, 3, 4, 13] for _ in range(num_samples)],
        torch.randint(3, 13, (num_samples, response_len), generator=g).tolist(),
        [[-1.0] * response_len for _ in range(num_samples)],
        advantages=[[1.0 if i % 2 else -1.0] * response_len for i in range(num_samples)])


def test_long_rollouts_train_with_partial_rollouts_and_flat_learner_memory(ray_cluster, tmp_path):
    from cluster.trainer import Trainer
    from learner.objective import count_normalizer

    model = build_talkative_model(tmp_path / "model")
    cfg = load_config(None, [
        f"output_dir={tmp_path / 'run'}", "logging.plots=false", f"model.path={model}", "model.dtype=float32",
        "algorithm.preset=dapo", "algorithm.dynamic_sampling=false",  # a random model earns no reward signal
        "learner.prompts_per_step=2", "rollout.samples_per_prompt=2", f"rollout.max_response_tokens={MAX_RESPONSE}",
        "train.max_staleness=1", "train.partial_rollouts=true", "rollout.prompts_in_flight=2",
        f"learner.max_tokens_per_micro_batch={BUDGET}", "learner.packing=true", "learner.logits_chunk_tokens=512",
        "learner.gradient_checkpointing=true", "data.num_eval_prompts=1"])
    trainer = Trainer(cfg)
    start = time.perf_counter()
    try:
        refs = [w.run.remote() for w in trainer.rollout_workers]
        rows = []
        for _ in range(2):
            groups, _ = trainer._wait_for_batch()
            rows.append(trainer.step(groups))
        ray.get(trainer.controller.stop.remote())
        ray.get(refs)
        # The learner alone, at the same token budget: 8 responses of 200 tokens, then of 2,400 tokens.
        peaks = {}
        for length in (200, 2400):
            batch = synthetic_batch(8, length)
            metrics = trainer.learner.train_step(batch, count_normalizer(batch.loss_mask, MAX_RESPONSE))
            peaks[length] = metrics["learner/peak_gib_max"]
            assert metrics["learner/effective_token_frac"] == 1.0
    finally:
        trainer.shutdown()
    seconds = time.perf_counter() - start
    assert len(rows) == 2
    lengths = [r["response/length_mean"] for r in rows]
    assert max(lengths) > 1000, lengths  # thousands of tokens per response, not a handful
    for r in rows:
        assert r["learner/effective_token_frac"] == 1.0  # packed rows: no padding
        # DAPO's soft overlong punishment: a response cut at the limit sits at the end of the buffer, -1 each,
        # and no sample's penalty is positive, so the shaped mean is at most raw mean - truncated fraction.
        assert r["reward/shaped_mean"] <= r["reward/mean"] - r["response/truncated_frac"] + 1e-6
    assert any(r["response/truncated_frac"] > 0 for r in rows)
    # 12x longer responses at the same token budget: the peak resident set of the learner process stays within
    # 25% (+ 64 MiB of allocator noise); without a budget the 2,400-token batch would be one 8 x 2,404 padded
    # micro-batch.
    assert peaks[2400] <= 1.25 * peaks[200] + 0.0625, peaks
    print(f"long rollouts: lengths {lengths}, learner peak GiB {peaks}, {seconds:.0f}s")
