"""relayrl's grpo, dapo, dr_grpo, gspo and cispo losses against TRL's GRPOTrainer loss (trl 1.16, the test extra).

TRL's own `_compute_loss` runs on a real GRPOTrainer around a tiny random Qwen2 model; relayrl's
`compute_policy_loss` gets the log-probs that TRL's own scoring returns for the same batch, the same old log-probs,
advantages and mask. Loss values and the gradients on every model parameter must agree. Where the two differ by
design (ALGORITHMS.md, "Beside TRL"), the test asserts the stated difference.
"""

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402  (trl pulls in datasets)
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from demos.arithmetic_model import build_random_model  # noqa: E402
from learner.aggregation import count_normalizer  # noqa: E402
from learner.objective import PolicyLossInputs, compute_policy_loss  # noqa: E402
from protocols.algorithm import AlgorithmConfig  # noqa: E402

B, P, T = 8, 5, 6
"""Rows (two groups of 4), prompt tokens, completion tokens (= max_completion_length, Dr.GRPO's constant)."""

# relayrl preset -> (its overrides: beta 0, bypass so that the ratio's denominator is the old log-probs as in TRL,
# no overlong shaping; TRL's GRPOConfig settings of the same objective)
SETTINGS = {
    "grpo": ({"kl": {"beta": 0.0}}, {"loss_type": "grpo", "epsilon": 0.2}),
    "dapo": ({}, {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}),
    "dr_grpo": ({}, {"loss_type": "dr_grpo", "epsilon": 0.2}),
    "gspo": ({}, {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4,
                  "epsilon_high": 4e-4}),
    # TRL's CISPO bound is the ratio's cap itself (ScaleRL's epsilon_max), relayrl's is 1 + eps_high (the paper's
    # clip(r, 1 - eps_low, 1 + eps_high)): relayrl's default eps_high 1.0 is TRL's epsilon_high 2.0.
    "cispo": ({}, {"loss_type": "cispo", "epsilon_high": 2.0}),
}


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    # The addition demo's architecture with random weights: no warm start needed to compare two losses.
    return build_random_model(tmp_path_factory.mktemp("parity_model"), tied=False, max_positions=32)


def trl_trainer(folder, tmp_path, **loss_settings) -> GRPOTrainer:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], beta=0.0,
                      per_device_train_batch_size=B, num_generations=4, max_completion_length=T,
                      temperature=1.0, **loss_settings)
    prompts = Dataset.from_dict({"prompt": ["12+34="] * B})
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=prompts, processing_class=tokenizer)
    trainer.model.train()
    # Set by Trainer's training loop; one micro-batch per optimizer step here.
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def batch(seed: int, empty_row: int | None = None) -> dict[str, torch.Tensor]:
    """A TRL batch: random prompt and completion tokens, completions of 1 to T tokens (right-padded), advantages
    (B,) and old log-probs within +-0.9 of what the model will score, so that some tokens clip."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    completion_mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    if empty_row is not None:
        completion_mask[empty_row] = 0  # a masked truncated sample (TRL's mask_truncated_completions)
    return {
        "prompt_ids": torch.randint(3, 15, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, 15, (B, T), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g),
        "old_noise": (torch.rand(B, T, generator=g) - 0.5) * 1.8,
        "num_items_in_batch": completion_mask.sum(),
    }


def trl_loss_and_grads(trainer: GRPOTrainer, inputs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]


def relayrl_loss_and_grads(trainer: GRPOTrainer, inputs: dict, cfg: AlgorithmConfig):
    """relayrl's loss on TRL's own log-probs of the same batch (same model, same forward pass code)."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logprobs, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention_mask, T)
    loss_mask = inputs["completion_mask"].bool()
    loss_inputs = PolicyLossInputs(
        behavior_logprobs=inputs["old_per_token_logps"],
        advantages=inputs["advantages"][:, None].expand(B, T),
        loss_mask=loss_mask,
    )
    loss, _ = compute_policy_loss(logprobs, loss_inputs, cfg, count_normalizer(loss_mask, T))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def with_old_logprobs(trainer: GRPOTrainer, inputs: dict) -> dict:
    """The batch with old log-probs = the model's own plus the batch's noise (ratios exp(-noise) in [0.41, 2.46])."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, T)
    out = {k: v for k, v in inputs.items() if k != "old_noise"}
    out["old_per_token_logps"] = current + inputs["old_noise"]
    return out


def relayrl_config(preset: str) -> AlgorithmConfig:
    overrides, _ = SETTINGS[preset]
    return AlgorithmConfig(preset=preset, off_policy={"mode": "bypass", "tis_cap": None},
                           overlong={"enabled": False}, **overrides)


@pytest.mark.parametrize("preset", sorted(SETTINGS))
def test_relayrl_loss_equals_trl_loss(preset, model_folder, tmp_path):
    trainer = trl_trainer(model_folder, tmp_path, **SETTINGS[preset][1])
    inputs = with_old_logprobs(trainer, batch(seed=1))
    trl_value, trl_grads = trl_loss_and_grads(trainer, inputs)
    ours_value, ours_grads = relayrl_loss_and_grads(trainer, inputs, relayrl_config(preset))
    torch.testing.assert_close(ours_value, trl_value, rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(ours_grads, trl_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)


def test_the_batch_exercises_the_clip():
    # old log-probs move the ratio by exp(+-0.9): some tokens leave PPO's [0.8, 1.28] band and CISPO's cap 2, so
    # the comparison covers both branches of the min and the capped weight, not only the unclipped surrogate.
    inputs = batch(seed=1)
    ratio = torch.exp(-inputs["old_noise"])[inputs["completion_mask"].bool()]
    assert bool((ratio > 2.0).any()) and bool((ratio < 0.8).any()) and bool(((ratio > 0.8) & (ratio < 1.2)).any())


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo"])
def test_a_fully_masked_sample_counts_in_trl_mean_but_not_in_ours(preset, model_folder, tmp_path):
    # A sample whose mask is all False (a truncated one under mask_truncated): TRL's grpo and dr_grpo divide by
    # all B rows, relayrl by the N_seq = B - 1 sequences with a loss token (ALGORITHMS.md, "Beside TRL"), so
    # relayrl's loss is TRL's times B / (B - 1) = 8 / 7, and so is every gradient.
    trainer = trl_trainer(model_folder, tmp_path, **SETTINGS[preset][1])
    inputs = with_old_logprobs(trainer, batch(seed=2, empty_row=3))
    trl_value, trl_grads = trl_loss_and_grads(trainer, inputs)
    ours_value, ours_grads = relayrl_loss_and_grads(trainer, inputs, relayrl_config(preset))
    torch.testing.assert_close(ours_value, trl_value * B / (B - 1), rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(ours_grads, trl_grads):
        torch.testing.assert_close(ours, theirs * B / (B - 1), rtol=1e-4, atol=1e-7)


def test_a_fully_masked_sample_changes_neither_token_mean(model_folder, tmp_path):
    # dapo's token mean divides by loss tokens in both: an all-False row adds no token to either count.
    trainer = trl_trainer(model_folder, tmp_path, **SETTINGS["dapo"][1])
    inputs = with_old_logprobs(trainer, batch(seed=2, empty_row=3))
    trl_value, _ = trl_loss_and_grads(trainer, inputs)
    ours_value, _ = relayrl_loss_and_grads(trainer, inputs, relayrl_config("dapo"))
    torch.testing.assert_close(ours_value, trl_value, rtol=1e-5, atol=1e-7)
