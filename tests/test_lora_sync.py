"""Adapter-only weight sync (model.lora): after a learner update, every transport sends the adapter alone, the engine
loads it in place, and vLLM scores fixed sequences under it as the learner does; the weight-sync check passes such
a load and catches one with an adapter tensor left out."""

import pytest

from tests.conftest import at_once
from tests.test_weight_sync import _sync_gap

pytestmark = pytest.mark.slow

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "weight_sync.bucket_mb=1"]
ADAPTER_BYTES = 65_536
"""The rank-4 adapter of the tiny model in fp32 (tests/test_lora_weights.py derives it)."""

SKIPPED = "base_model.model.model.layers.0.mlp.down_proj.lora_"
"""Both matrices of one adapter module (vLLM refuses an adapter with one of a pair missing): the corrupted load
leaves that layer without its adapter, one AdamW step at lr 1e-2 in."""


def _probe_check(found: dict, path: str, cfg, learner, worker, batch) -> None:
    """Version 1 (loaded by _sync_gap) passes the sync check under the adapter; version 2 loaded without one
    module's adapter fails it; version 3 passes again."""
    import ray
    from transformers import AutoTokenizer

    from learner.objective import count_normalizer
    from weights.sync_check import WeightCheck, WeightSyncMismatch

    check = WeightCheck(cfg, len(AutoTokenizer.from_pretrained(path)),
                        cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens)
    probe_batch = check.learner_batch(cfg.learner.num_ranks)

    def train_and_load(version: int) -> list[dict]:
        learner.train_step(batch, count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens))
        published = learner.publish_weights(version)
        found.setdefault("bytes", []).append(published.num_bytes)
        ray.get(worker.load_weights.remote(published))
        check.record_learner(version, probe_batch.per_sample_rows(learner.probe_logprobs(probe_batch)))
        return ray.get(worker.weight_probes.remote())

    check.record_learner(1, probe_batch.per_sample_rows(learner.probe_logprobs(probe_batch)))
    (gap,) = check.compare(0, ray.get(worker.weight_probes.remote()))
    found["clean"] = gap.max_gap
    ray.get(worker.inject_weight_fault.remote(SKIPPED))
    with pytest.raises(WeightSyncMismatch) as err:
        check.compare(0, train_and_load(2))
    found["message"] = str(err.value)
    ray.get(worker.inject_weight_fault.remote(None))
    (gap,) = check.compare(0, train_and_load(3))
    found["clean_after"] = gap.max_gap


@pytest.mark.parametrize("transport", [["weight_sync.type=object_store"],
                                       ["weight_sync.type=object_store", "weight_sync.delta=true"],
                                       ["weight_sync.type=collective"]], ids=["object_store", "delta", "collective"])
def test_engine_matches_learner_under_the_adapter(ray_cluster, tiny_models, transport):
    found: dict = {}
    gap, moved, published, _rpcs, _load_s = at_once((_sync_gap, ray_cluster, tiny_models["tied"], [*LORA, *transport],
                                                      lambda *args: _probe_check(found, *args)))[0]
    print(f"LoRA sync {transport}: gap {gap:.3g}, moved {moved:.3g}, probe {found}")
    assert gap < 1e-4, f"vLLM under the adapter and the learner differ by {gap}"
    assert moved > 1e-2, f"the update moved vLLM's log-probs by only {moved}"
    # each version sends the adapter alone. Delta sync sends its first version whole; after that AdamW changes every
    # adapter element each step, so the delta would be as large as the adapter and the object store puts the
    # version whole as a new keyframe instead (weights/object_store.py): the adapter's bytes, once
    assert published.num_tensors == 28
    if "weight_sync.delta=true" in transport:
        assert published.num_bytes == ADAPTER_BYTES and published.delta.base_version is None
        assert found["bytes"] == [ADAPTER_BYTES] * len(found["bytes"]), found["bytes"]
    else:
        assert published.num_bytes == ADAPTER_BYTES and found["bytes"] == [ADAPTER_BYTES] * 2
    assert found["clean"] < 1e-3 and found["clean_after"] < 1e-3, found
    assert "policy version 2" in found["message"], found
