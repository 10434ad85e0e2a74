"""LoRA on the DeepSpeed learner ranks (model.lora): only the adapter trains and leaves the rank, 1 or 2 ranks under
ZeRO-2 and ZeRO-3 give the same update, the base model is untouched, the reference is the base model with the adapter
disabled, and a checkpoint holds the adapter and its optimizer state and loads back."""

import pytest
import ray
import torch

from learner.objective import count_normalizer
from protocols.config import load_config
from tests.conftest import at_once
from tests.test_learner_sharding import make_batch

pytestmark = pytest.mark.slow

SETTINGS = ["learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "learner.micro_batch_size=2",
            "learner.lr=1e-2", "model.lora.rank=4", "model.lora.alpha=8"]


def run_one_step(model_path: str, num_ranks: int, zero_stage: int, folder: str) -> dict:
    from cluster.learner_group import LearnerGroup

    # grpo has a KL term: with reference.num_workers=0 the learner scores the reference itself
    cfg = load_config(None, [f"learner.num_ranks={num_ranks}", f"learner.zero_stage={zero_stage}",
                             "algorithm.preset=grpo", *SETTINGS])
    batch = make_batch(8)
    group = LearnerGroup(cfg, model_path)
    try:
        before = group.policy_logprobs(batch)
        ref_before = group.ref_logprobs(batch)
        metrics = group.train_step(batch, count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens))
        announcement = group.publish_weights(1)
        packed = ray.get(announcement.refs[0])
        after = group.policy_logprobs(batch)
        ref_after = group.ref_logprobs(batch)
        trained = ray.get(group.group.ranks[0].__ray_call__.remote(
            lambda rank: [sum(p.numel() for p in g["params"]) for g in
                          getattr(rank.engine.optimizer, "optimizer", rank.engine.optimizer).param_groups]))
        group.save_hf(f"{folder}/saved")
        saved = group.save_state(f"{folder}/state")
        loaded = group.load_state(f"{folder}/state")
    finally:
        group.shutdown()
    return {"metrics": metrics, "weights": {k: torch.from_numpy(v.copy()) for k, (_, v) in packed.items()},
            "num_bytes": announcement.num_bytes, "before": before, "after": after, "ref_before": ref_before,
            "ref_after": ref_after, "optimizer_numel": trained, "saved": saved, "loaded": loaded}


def test_lora_trains_the_adapter_alone_the_same_on_one_or_two_ranks(ray_cluster, tiny_models, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tiny_models["tied"]
    base, *sharded = at_once(*[(run_one_step, path, ranks, stage, str(tmp_path / f"{ranks}_{stage}"))
                               for ranks, stage in ((1, 2), (2, 2), (2, 3))])
    # 2 layers x 7 projections x (A, B); rank 4 on hidden 128, one KV head of 64, MLP 256: 65,536 bytes (fp32,
    # tests/test_lora_weights.py derives it)
    assert len(base["weights"]) == 28 and all(".lora_" in name for name in base["weights"])
    assert base["num_bytes"] == 65_536
    # the optimizer holds the adapter alone (ZeRO-2 flattens it into one partition per rank: 16,384 elements)
    assert base["optimizer_numel"] == [16_384]
    for result, stage in zip(sharded, (2, 3)):
        assert result["num_bytes"] == 65_536
        assert result["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], rel=1e-5, abs=1e-7), stage
        for name, tensor in base["weights"].items():
            torch.testing.assert_close(result["weights"][name], tensor, rtol=0, atol=2e-5, msg=f"{stage} {name}")
    for result in (base, *sharded):
        # B starts at zero, so before the step the policy is the base model: the reference (adapter disabled)
        # equals it; after the step the policy moved and the reference did not
        torch.testing.assert_close(result["ref_before"], result["before"], rtol=0, atol=1e-6)
        torch.testing.assert_close(result["ref_after"], result["ref_before"], rtol=0, atol=1e-6)
        assert (result["after"] - result["before"]).abs().max() > 1e-3
        assert result["loaded"] == result["saved"]  # the optimizer state came back whole
    # the saved folder: the merged model loads in plain transformers, the adapter in peft, and both score as the
    # learner does after its step; the base model in model.path is unchanged
    # (ZeRO-3's folder too, merged a bucket of weight_sync.bucket_mb at a time on 2 ranks)
    ids = torch.tensor([[1, 3, 13, 5, 14, 7, 8]])
    for result, run in ((base, "1_2"), (sharded[1], "2_3")):
        folder = tmp_path / run / "saved"
        merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                                               str(folder / "adapter")).eval()
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, rtol=1e-5, atol=1e-5, msg=run)
        adapter = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
        for name, tensor in result["weights"].items():
            torch.testing.assert_close(adapter[name], tensor, rtol=0, atol=0, msg=f"{run} {name}")
    # the checkpoint holds the adapter, not the base model: far smaller than the 2 x 0.3M-parameter model
    states = list((tmp_path / "1_2" / "state" / "ds").glob("*model_states.pt"))
    assert states and all(p.stat().st_size < 200_000 for p in states)
