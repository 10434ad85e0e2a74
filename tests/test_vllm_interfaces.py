"""The installed vLLM offers every interface relayrl loads weights through (actors/vllm_weights.py), and a bad
transport name in the config is refused with the allowed ones."""

import pytest

from protocols.config import ConfigError, load_config


def test_installed_vllm_has_the_interfaces_relayrl_uses():
    from actors.vllm_weights import TESTED_VLLM, check_vllm_interfaces

    # check_vllm_interfaces raises RuntimeError naming each missing interface and the tested versions; this
    # test then fails with that message.
    version = check_vllm_interfaces()
    assert version in TESTED_VLLM.values(), (
        f"vLLM {version} passes the interface check but is not a tested version {TESTED_VLLM}: run the "
        "exact-sync tests (tests/test_weight_sync.py) and add it to TESTED_VLLM and pyproject.toml")


def test_unknown_weight_transport_lists_the_allowed_ones():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["weight_sync.type=rdma"])
    assert "'object_store'" in str(err.value) and "'collective'" in str(err.value)
    cfg = load_config(None, ["weight_sync.type=collective", "weight_sync.bucket_mb=64"])
    assert cfg.weight_sync.type == "collective" and cfg.weight_sync.bucket_mb == 64
    assert load_config(None).weight_sync.type == "object_store"
    with pytest.raises(ConfigError, match=r"`weight_sync.object_store.timeout_s`; allowed keys here: bucket_mb, .*type"):
        load_config(None, ["weight_sync.timeout_s=5"])  # only the collective backend has a timeout


def test_installed_vllm_has_the_native_weight_transfer_api():
    # Not used yet (docs/weight_sync.md, "vLLM's weight-transfer engine"): the GPU path `collective` could move to.
    # This names what that path would call, so an upgrade that moves it is seen here first.
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.v1.worker.gpu_worker import Worker

    for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
        assert callable(getattr(LLM, name, None)), f"vllm.LLM.{name} is gone"
        assert callable(getattr(Worker, name, None)), f"vllm Worker.{name} is gone"
    for backend in ("nccl", "sparse_nccl"):
        assert backend in WeightTransferEngineFactory._registry, f"no {backend} engine-side weight transfer"
        assert backend in WeightTransferTrainerFactory._registry, f"no {backend} trainer-side weight transfer"
    assert WeightTransferConfig(backend="sparse_nccl").backend == "sparse_nccl"


def test_a_rollout_worker_runs_the_interface_check_before_it_builds_its_engine(monkeypatch):
    """The check is called at start, not only by this suite: a vLLM that fails it stops the worker there, with the
    check's message, before an engine exists."""
    import actors.rollout_worker as rollout_worker

    def planted() -> str:
        raise RuntimeError("planted: vllm.LLM.collective_rpc is missing")

    monkeypatch.setattr(rollout_worker, "check_vllm_interfaces", planted)
    monkeypatch.setattr(rollout_worker, "configure_vllm_env", lambda cfg: None)  # leaves this process's env alone
    with pytest.raises(RuntimeError, match="planted: vllm.LLM.collective_rpc is missing"):
        rollout_worker.RolloutWorker(load_config(None), 0, "no-model-folder")
