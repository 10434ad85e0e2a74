"""Weight sync is exact for every transport: after a learner update and a push, vLLM scores fixed sequences as
the learner does (tied and untied embeddings; and a tensor-parallel engine, whose every rank must load)."""

import pytest
import ray
import torch

from learner.objective import count_normalizer
from protocols.config import load_config
from tests.test_learner_sharding import make_batch

pytestmark = pytest.mark.slow


def _sync_gap(ray_cluster, path: str, overrides: list[str]) -> tuple[float, float, dict]:
    """(max |vLLM - learner| after the push, max movement of vLLM's log-probs, the publish result)."""
    from actors.rollout_worker import RolloutWorker
    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, ["learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "learner.lr=1e-2",
                             "algorithm.preset=dapo", "data.max_prompt_tokens=16", *overrides])
    learner = LearnerGroup(cfg, path)
    worker = ray.remote(RolloutWorker).options(num_cpus=1).remote(cfg, 0, path)
    try:
        learner.join_weight_group([worker])  # nothing to join for object_store
        batch = make_batch(8, seed=3)
        responses = [batch.response(i) for i in range(batch.num_samples)]
        before = ray.get(worker.sequence_logprobs.remote(batch.prompt_ids, responses))
        learner.train_step(batch, count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens))
        published = learner.publish_weights(1)
        ray.get(worker.load_weights.remote(1, published["refs"]))
        assert ray.get(worker.get_version.remote()) == 1
        after_vllm = ray.get(worker.sequence_logprobs.remote(batch.prompt_ids, responses))
        after_learner = batch.per_sample_rows(learner.policy_logprobs(batch))
    finally:
        learner.shutdown()
        ray.kill(worker)
    flat = lambda rows: torch.tensor([x for row in rows for x in row])  # noqa: E731
    gap = (flat(after_vllm) - flat(after_learner)).abs().max().item()
    moved = (flat(after_vllm) - flat(before)).abs().max().item()
    return gap, moved, published


@pytest.mark.parametrize("transport", ["object_store", "collective"])
@pytest.mark.parametrize("variant", ["tied", "untied"])
def test_vllm_matches_learner_after_update_and_push(ray_cluster, tiny_models, variant, transport):
    # bucket_mb=1: the tiny model (about 1.3 MB of fp32) travels in more than one bucket
    gap, moved, published = _sync_gap(ray_cluster, tiny_models[variant],
                                      [f"weight_sync.type={transport}", "weight_sync.bucket_mb=1"])
    assert (published["refs"] == []) == (transport == "collective")
    assert gap < 1e-4, f"{variant}/{transport}: vLLM and learner log-probs differ by {gap} after the push"
    # lr 1e-2 moves log-probs far more than the tolerance, so a push that did nothing cannot pass
    assert moved > 1e-2, f"{variant}/{transport}: the update moved vLLM's log-probs by only {moved}"


def test_tensor_parallel_engine_loads_pushed_weights_on_every_rank(ray_cluster, tiny_models):
    # Two ranks each hold half of every sharded matrix; a rank that kept old weights would move the log-probs.
    gap, moved, _ = _sync_gap(ray_cluster, tiny_models["tied"],
                              ["weight_sync.type=collective", "rollout.tensor_parallel_size=2"])
    assert gap < 1e-4, f"tensor-parallel engine differs from the learner by {gap} after the push"
    assert moved > 1e-2


def test_training_run_with_a_tensor_parallel_engine_and_collective_sync(ray_cluster, tmp_path):
    """End to end: one rollout engine of two tensor-parallel ranks fed by the collective transport."""
    from cluster.trainer import Trainer

    cfg = load_config(None, [f"output_dir={tmp_path}", "train.steps=4", "learner.prompts_per_step=4",
                             "rollout.samples_per_prompt=4", "data.num_eval_prompts=16", "train.max_staleness=1",
                             "rollout.tensor_parallel_size=2", "weight_sync.type=collective"])
    trainer = Trainer(cfg)
    try:
        summary = trainer.run()
        final_version = ray.get(trainer.rollout_workers[0].get_version.remote())
    finally:
        trainer.shutdown()
    assert summary["steps"] == 4
    (report,) = summary["rollout"]
    # the engine moved to newer weights while it ran; after the run it holds the last version
    assert report["versions_seen"][0] == 0 and len(report["versions_seen"]) >= 2
    assert final_version == 4
    assert 0.0 <= summary["accuracy_after"] <= 1.0
