"""The learner's object-store publish under ZeRO-3: parameters gathered a bucket at a time (here many buckets)
arrive complete and exact, tied lm_head included, with both ranks taking part in every gather."""

import pytest
import ray
import torch

from protocols.config import load_config
from weights.object_store import unpack_state_dict

pytestmark = pytest.mark.slow


def test_zero3_publish_gathers_per_bucket_and_matches_the_checkpoint(ray_cluster, tiny_models):
    from safetensors.torch import load_file

    from cluster.learner_group import LearnerGroup

    # bucket_mb=1 against ~1.3 MB of fp32 weights: at least two gathers
    cfg = load_config(None, ["learner.num_ranks=2", "learner.zero_stage=3", "learner.prompts_per_step=2",
                             "rollout.samples_per_prompt=2", "weight_sync.bucket_mb=1"])
    group = LearnerGroup(cfg, tiny_models["tied"])
    try:
        first = group.publish_weights(1)
        second = group.publish_weights(2)  # the reused host buffers give the same bytes again
        weights = dict(unpack_state_dict(ray.get(second.refs[0])))
        again = dict(unpack_state_dict(ray.get(first.refs[0])))
    finally:
        group.shutdown()
    initial = load_file(f"{tiny_models['tied']}/model.safetensors")
    expected = {**initial, "lm_head.weight": initial["model.embed_tokens.weight"]}
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0, msg=name)
    assert second.num_bytes == sum(t.numel() * t.element_size() for t in expected.values())
