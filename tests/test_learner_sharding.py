"""DeepSpeed learner ranks: the same global batch gives the same loss and update on 1 or 2 ranks, ZeRO 2 and 3."""

import pytest
import ray
import torch

from learner.objective import count_normalizer
from protocols.config import load_config
from protocols.training_batch import TrainingBatch
from tests.conftest import at_once

pytestmark = pytest.mark.slow


def make_batch(num_samples: int, seed: int = 0) -> TrainingBatch:
    # Ragged responses so token-mean aggregation differs from a per-rank mean if the normalizer were local.
    g = torch.Generator().manual_seed(seed)
    prompts, responses, behavior, advantages = [], [], [], []
    for i in range(num_samples):
        length = 1 + i % 4
        prompts.append([1, 3 + i % 10, 13, 3 + (i * 7) % 10, 14])
        responses.append(torch.randint(3, 13, (length,), generator=g).tolist())
        behavior.append((-2.5 + 0.1 * torch.randn(length, generator=g)).tolist())
        advantages.append([1.0 if i % 2 else -1.0] * length)
    return TrainingBatch.from_samples(prompts, responses, behavior, advantages=advantages)


def run_one_step(model_path: str, num_ranks: int, zero_stage: int) -> tuple[dict, dict]:
    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, [f"learner.num_ranks={num_ranks}", f"learner.zero_stage={zero_stage}",
                             "learner.prompts_per_step=2", "rollout.samples_per_prompt=4",
                             "learner.micro_batch_size=2", "learner.lr=1e-3", "algorithm.preset=dapo"])
    batch = make_batch(8)
    group = LearnerGroup(cfg, model_path)
    try:
        metrics = group.train_step(batch, count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens))
        packed = __import__("ray").get(group.publish_weights().refs[0])
    finally:
        group.shutdown()
    return metrics, {k: torch.from_numpy(v.copy()) for k, (_, v) in packed.items()}


def test_two_ranks_match_one_rank_under_zero2_and_zero3(ray_cluster, tiny_models):
    # the three groups (5 rank processes, each group its own placement group and rendezvous) run at once
    path = tiny_models["untied"]
    (base_metrics, base_weights), *sharded = at_once(*[(run_one_step, path, ranks, stage)
                                                        for ranks, stage in ((1, 2), (2, 2), (2, 3))])
    for stage, (metrics, weights) in zip((2, 3), sharded):
        # the loss is summed over ranks as shares of the global loss, so it must match exactly up to fp error
        assert metrics["loss"] == pytest.approx(base_metrics["loss"], rel=1e-5, abs=1e-7), stage
        # Adam is blind to a constant gradient scale; the global gradient norm is not.
        assert metrics["grad_norm_max"] == pytest.approx(base_metrics["grad_norm_max"], rel=1e-4), stage
        # Adam's first step moves each weight by about lr * sign(grad) = 1e-3. Where the true gradient is ~0 (the
        # k_proj bias: softmax ignores a constant shift), float noise decides that sign, so the tolerance is 2% of
        # one step (2e-5) rather than machine precision; a wrong normalizer would be off by a whole step.
        for name, tensor in base_weights.items():
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=2e-5, msg=f"stage {stage} {name}")
    # and the update did something: lr 1e-3 with Adam moves every trained weight by about 1e-3
    from safetensors.torch import load_file

    initial = load_file(f"{tiny_models['untied']}/model.safetensors")
    moved = (base_weights["model.layers.0.mlp.up_proj.weight"] - initial["model.layers.0.mlp.up_proj.weight"]).abs()
    assert moved.max() > 1e-4


def record_gathers(rank) -> None:
    """In a rank process: note the bytes of every ZeRO-3 gather from now on (`rank.gathered_bytes`), through
    DeepSpeed's own GatheredParameters."""
    import deepspeed

    real, rank.gathered_bytes = deepspeed.zero.GatheredParameters, []

    class Recording(real):
        def __init__(self, params, *args, **kwargs):
            rank.gathered_bytes.append(sum(p.ds_numel * p.element_size() for p in params))
            super().__init__(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = Recording


def expected_gathers(model, limit: int) -> list[int]:
    """Bytes of each bucket of `model`'s state dict (learner/rank_weights.py `buckets`), a tied matrix counted once
    per bucket, as the ranks gather it."""
    from learner.rank_weights import buckets

    state = model.state_dict()
    tensors = list(state.values())
    out = []
    for bucket in buckets([t.numel() * t.element_size() for t in tensors], limit):
        unique = {tensors[i].data_ptr(): tensors[i] for i in bucket}
        out.append(sum(t.numel() * t.element_size() for t in unique.values()))
    return out


def test_saved_model_round_trips_under_zero3_with_tied_embeddings(ray_cluster, tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    from cluster.learner_group import LearnerGroup

    # weight_sync.bucket_mb=1: the tiny model (about 1.2 MB of fp32) is gathered in more than one bucket
    cfg = load_config(None, ["learner.num_ranks=2", "learner.zero_stage=3", "learner.prompts_per_step=2",
                             "rollout.samples_per_prompt=2", "weight_sync.bucket_mb=1"])
    group = LearnerGroup(cfg, tiny_models["tied"])
    try:
        ray.get([rank.__ray_call__.remote(record_gathers) for rank in group.ranks])
        group.save_hf(str(tmp_path / "saved"))
        gathered = ray.get([rank.__ray_call__.remote(lambda rank: rank.gathered_bytes) for rank in group.ranks])
        # the ranks joined their group without DeepSpeed's shared-memory inference op (learner/rank_setup.py):
        # nothing here calls it, and building it is a C++ compile
        shm_ops = ray.get([rank.__ray_call__.remote(lambda _: __import__("deepspeed").comm.comm.cdb.shm_comm_op)
                           for rank in group.ranks])
        # and without TorchInductor, which DeepSpeed's ZeRO-3 optimizer would load for a Muon it does not run
        # (cluster/rank_group.py RANK_ENV)
        loaded = lambda _: "torch._inductor.compile_fx" in __import__("sys").modules  # noqa: E731
        inductor = ray.get([rank.__ray_call__.remote(loaded) for rank in group.ranks])
    finally:
        group.shutdown()
    assert shm_ops == [None, None] and inductor == [False, False]
    model = AutoModelForCausalLM.from_pretrained(tiny_models["tied"])
    original = model.state_dict()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert saved.keys() == original.keys()
    for name, tensor in original.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0, msg=name)
    # the file is the one save_pretrained writes from a host copy of the whole state dict, byte for byte
    model.save_pretrained(tmp_path / "whole", state_dict={k: v.detach().clone() for k, v in original.items()})
    assert (tmp_path / "saved" / "model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "model.safetensors").read_bytes()
    # both ranks entered the same gathers, a bucket at a time: never the whole model at once
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert gathered[0] == gathered[1] == expected_gathers(model, 2**20)
    assert len(gathered[0]) >= 2 and max(gathered[0]) < whole
