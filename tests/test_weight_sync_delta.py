"""Delta sync on the real stack (weight_sync.delta, weights/delta.py): a real vLLM engine fed by a real
DeepSpeed learner through each transport, after several optimizer steps, holds the learner's weights bit for bit
and scores exactly as after a full version; a worker that is new (a replacement) or behind reads a full version.
One engine + learner pair per transport (each costs about 45 s)."""

import pytest
import ray
import torch

from actors.rollout_worker import RolloutWorker
from learner.objective import count_normalizer
from protocols.config import load_config
from protocols.weight_announcement import WeightAnnouncement
from tests.test_learner_sharding import make_batch
from weights.delta import bits

pytestmark = pytest.mark.slow


class DeltaWorker(RolloutWorker):
    """A rollout worker that also shows what its receiver holds (tests only)."""

    def held_bits(self) -> dict[str, torch.Tensor]:
        receiver = self.receiver
        held = receiver.held if hasattr(receiver, "held") else receiver.membership._views
        return {name: bits(t.contiguous()).clone() for name, t in held}

    def read_bytes(self) -> int:
        return self.receiver.read_bytes

    def replace_receiver(self) -> None:
        """Forget the held copy, as a replacement worker starts (the engine keeps its weights)."""
        self.receiver.close()
        self.receiver = type(self.receiver)(self.cfg)


def _learner_bits(learner, tmp_path) -> dict[str, torch.Tensor]:
    """The learner's weights as written by save_hf (an independent full copy), as raw bits."""
    from safetensors.torch import load_file

    folder = learner.save_hf(str(tmp_path / "hf"))
    return {name: bits(t.contiguous()) for name, t in load_file(f"{folder}/model.safetensors").items()}


def _setup(tiny_models, transport: str):
    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, ["learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "learner.lr=1e-3",
                             "algorithm.preset=dapo", "data.max_prompt_tokens=16", f"weight_sync.type={transport}",
                             "weight_sync.delta=true", "weight_sync.bucket_mb=1", "weight_sync.verify_every=0"])
    # the engine starts in its actor while the learner group starts here (the two starts overlap)
    worker = ray.remote(DeltaWorker).options(num_cpus=1).remote(cfg, 0, tiny_models["tied"])
    try:
        learner = LearnerGroup(cfg, tiny_models["tied"])
    except BaseException:
        ray.kill(worker)
        raise
    learner.join_weight_group([worker])
    return cfg, learner, worker


def _train_and_push(learner, worker, batch, cfg, version: int, load: bool = True) -> WeightAnnouncement:
    learner.train_step(batch, count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens))
    published = learner.publish_weights(version)
    if load:
        ray.get(worker.load_weights.remote(published))
    return published


def _scores(worker, batch):
    responses = [batch.response(i) for i in range(batch.num_samples)]
    return ray.get(worker.sequence_logprobs.remote(batch.prompt_ids, responses))


def _assert_same(held: dict, reference: dict) -> None:
    for name, expected in reference.items():
        assert torch.equal(held[name], expected), f"{name} differs from the learner's bits"


def test_object_store_deltas_equal_the_learner_bit_for_bit_and_a_new_worker_reads_full(ray_cluster, tiny_models,
                                                                                       tmp_path):
    cfg, learner, worker = _setup(tiny_models, "object_store")
    try:
        batch = make_batch(8, seed=3)
        before = _scores(worker, batch)
        first = _train_and_push(learner, worker, batch, cfg, 1)
        assert first.delta.base_version is None  # nothing to encode against yet
        for version in (2, 3):
            published = _train_and_push(learner, worker, batch, cfg, version)
            assert published.delta.base_version == version - 1
        # behind: versions 4 and 5 published, the worker loads 5 from 3 (two deltas, or the keyframe)
        _train_and_push(learner, worker, batch, cfg, 4, load=False)
        published = _train_and_push(learner, worker, batch, cfg, 5)
        assert ray.get(worker.get_version.remote()) == 5
        _assert_same(ray.get(worker.held_bits.remote()), _learner_bits(learner, tmp_path))
        after_deltas = _scores(worker, batch)
        assert after_deltas != before
        learner_rows = batch.per_sample_rows(learner.policy_logprobs(batch))
        gap = max(abs(a - b) for ra, rb in zip(after_deltas, learner_rows) for a, b in zip(ra, rb))
        assert gap < 1e-4, f"engine and learner differ by {gap} after five delta-synced versions"
        # a replacement worker holds nothing: it reads the keyframe (a full version) and the deltas after it, and
        # the engine then scores exactly as after the delta path (same bits loaded)
        ray.get(worker.replace_receiver.remote())
        republished = learner.publish_weights(6)  # no step: the same weights, an empty delta
        assert republished.delta.changed_elements == 0
        keyframe = republished.refs[0]
        ray.get(worker.load_weights.remote(republished))
        assert ray.get(worker.read_bytes.remote()) >= keyframe[-1]
        _assert_same(ray.get(worker.held_bits.remote()), _learner_bits(learner, tmp_path))
        assert _scores(worker, batch) == after_deltas
    finally:
        learner.shutdown()
        ray.kill(worker)


def test_collective_deltas_equal_a_full_broadcast_bit_for_bit(ray_cluster, tiny_models, tmp_path):
    cfg, learner, worker = _setup(tiny_models, "collective")
    try:
        batch = make_batch(8, seed=3)
        assert _train_and_push(learner, worker, batch, cfg, 1).delta.base_version is None
        _train_and_push(learner, worker, batch, cfg, 2)
        _train_and_push(learner, worker, batch, cfg, 3, load=False)  # the loop skips 3; its thread applies it
        published = _train_and_push(learner, worker, batch, cfg, 4)
        assert published.delta.base_version == 3 and ray.get(worker.get_version.remote()) == 4
        _assert_same(ray.get(worker.held_bits.remote()), _learner_bits(learner, tmp_path))
        after_deltas = _scores(worker, batch)
        # a rejoin (as after a replaced engine) opens a new group whose first broadcast is full: same weights,
        # so the engine must score exactly as after the deltas
        learner.join_weight_group([worker])
        full = learner.publish_weights(5)
        assert full.delta.base_version is None
        ray.get(worker.load_weights.remote(full))
        assert _scores(worker, batch) == after_deltas
        _assert_same(ray.get(worker.held_bits.remote()), _learner_bits(learner, tmp_path))
    finally:
        learner.shutdown()
        ray.kill(worker)
