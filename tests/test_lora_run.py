"""A LoRA GRPO run on the real stack (model.lora): the weight-sync check passes at every version, each sync moves the
adapter's bytes alone, the learner's base weights never change, final_model/ loads in transformers (merged) and in
peft (adapter/), and the run resumes from its LoRA checkpoint with no group trained twice. A LoRA engine cannot
share the session's plain engines (enable_lora is fixed at its start), so this is one short run and its resume."""

import json
from pathlib import Path

import pytest
import ray
import torch

from cluster.trainer import Trainer
from protocols.config import load_config

pytestmark = pytest.mark.slow

ADAPTER_BYTES = 131_072
"""The rank-8 adapter of the demo model in fp32: twice the rank-4 one of tests/test_lora_weights.py (65,536)."""


def _base_weights(rank) -> dict[str, torch.Tensor]:
    """Runs in learner rank 0: its frozen base weights under the base model's own names."""
    return {name.removeprefix("base_model.model.").replace(".base_layer.", "."): p.detach().clone()
            for name, p in rank.engine.module.named_parameters() if ".lora_" not in name}


def test_lora_grpo_run_syncs_the_adapter_alone_and_resumes(ray_cluster, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    settings = [f"output_dir={tmp_path}", "logging.plots=false", "model.lora.rank=8", "model.lora.alpha=16",
                "algorithm.preset=grpo", "learner.lr=1e-3", "train.max_staleness=0", "train.save_every=2",
                "learner.prompts_per_step=4", "rollout.samples_per_prompt=4", "data.num_eval_prompts=16"]
    trainer = Trainer(load_config(None, [*settings, "train.steps=3"]))
    try:
        summary = trainer.run()
        # on-policy: the engine loads every version, and the check compared each of them with the learner
        checked = sorted({version for _, version in trainer.weight_check.compared})
        base = ray.get(trainer.learner.ranks[0].__ray_call__.remote(_base_weights))
        model_path = trainer.model_path
    finally:
        trainer.shutdown()
    assert checked == [1, 2, 3], checked
    check = summary["weight_sync_check"]
    assert check["max_gap"] < check["tolerance"] == 1e-3, check
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["weights/bytes"] for r in rows] == [ADAPTER_BYTES] * 3
    # the base model did not move: every frozen weight equals model.path's, bit for bit
    initial = load_file(f"{model_path}/model.safetensors")
    assert base.keys() >= initial.keys()
    for name, tensor in initial.items():
        torch.testing.assert_close(base[name], tensor, rtol=0, atol=0, msg=name)
    # final_model: the merged model in transformers and base + adapter in peft score alike, and differ from the base
    final = Path(summary["final_model"])
    ids = torch.tensor([[1, 3, 13, 5, 14, 7, 8]])
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32),
                                        str(final / "adapter")).eval()
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
        assert (merged(ids).logits - plain(ids).logits).abs().max() > 1e-4

    # resume from the step-2 checkpoint to step 4: steps 3 and 4 are trained (again), nothing before them
    trainer = Trainer(load_config(None, [*settings, "train.steps=4"]), resume_dir=tmp_path)
    try:
        resumed = trainer.run()
        checked = sorted({version for _, version in trainer.weight_check.compared})
    finally:
        trainer.shutdown()
    assert resumed["resume"]["policy_version"] == 2 and resumed["steps"] == 4
    loaded = resumed["resume"]["optimizer_loaded"][0]
    assert loaded["step"] == 2.0  # the adapter's Adam state came back with its two steps
    assert checked == [2, 3, 4], checked  # the restored adapter (published at resume), then each new version
    trained = resumed["trained_group_ids"]
    assert len(trained) == len(set(trained)) == 4 * 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
