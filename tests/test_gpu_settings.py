"""What a GPU run is given, checked on a CPU machine without starting vLLM, Ray or DeepSpeed: the engine's `LLM(...)`
arguments, the hint when it fails to start, a GPU role without CUDA, what each actor may see of the node's GPUs,
and the device-aware defaults (dtype, memory share, CUDA graphs, the sync check's tolerance)."""

import dataclasses
import os

import pytest
import torch
import yaml
from ray.util.placement_group import PlacementGroup

from actors.engine_args import engine_args, start_failure_hint
from cluster.critic_group import critic_options
from cluster.placement import HIDDEN_GPUS, Placement, plan_placement, with_env
from cluster.ray_setup import reward_options, rollout_options
from learner.rank_setup import DeepSpeedRank, require_cuda
from protocols.config import RunConfig, dump_config, load_config
from protocols.device_defaults import GPU_16BIT_SYNC_TOLERANCE
from weights.sync_check import WeightCheck, WeightSyncMismatch

GPU = ["cluster.use_gpus=true"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU role on a machine without CUDA")


# --- the engine's arguments -------------------------------------------------------------------------------------
def test_async_scheduling_is_off_on_gpus_as_on_cpu():
    # vLLM's own default turns it on for CUDA (and forces it off on CPU): relayrl must pass False on both
    for overrides in ([], GPU, [*GPU, "rollout.tensor_parallel_size=2"]):
        assert engine_args(load_config(None, overrides), 0, "/models/m")["async_scheduling"] is False


def test_engine_args_name_every_setting_relayrl_relies_on():
    cpu = engine_args(load_config(None, ["train.seed=3"]), 2, "/models/m")
    # seed 3 + 1000 * worker 2; context 256 prompt + 16 response = 272; CPU step budget max(256 * 272, 4096) = 69632
    assert cpu == {"model": "/models/m", "dtype": "float32", "seed": 2003, "gpu_memory_utilization": 0.1,
                   "tensor_parallel_size": 1, "max_model_len": 272, "max_num_seqs": 256,
                   "max_num_batched_tokens": 69632, "async_scheduling": False,
                   "enforce_eager": True, "enable_prefix_caching": True, "logprobs_mode": "processed_logprobs",
                   "trust_remote_code": False, "distributed_executor_backend": "uni",
                   "worker_extension_cls": "actors.vllm_worker_extension.WeightLoader"}
    gpu = engine_args(load_config(None, GPU), 0, "/models/m")
    # GPUs keep vLLM's step budget; bf16, 0.85 and CUDA graphs are the GPU defaults
    assert "max_num_batched_tokens" not in gpu
    assert (gpu["dtype"], gpu["gpu_memory_utilization"], gpu["enforce_eager"]) == ("bfloat16", 0.85, False)
    tp = engine_args(load_config(None, [*GPU, "rollout.tensor_parallel_size=2"]), 0, "/models/m")
    assert tp["distributed_executor_backend"] == "ray" and tp["tensor_parallel_size"] == 2
    lora = engine_args(load_config(None, [*GPU, "model.lora.rank=8"]), 0, "/models/m")
    assert (lora["enable_lora"], lora["max_lora_rank"], lora["max_loras"]) == (True, 8, 1)


def test_every_engine_keyword_is_a_field_of_the_installed_engine_args():
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    used = set()
    for overrides in ([], GPU, [*GPU, "rollout.tensor_parallel_size=2", "model.lora.rank=8"]):
        used |= set(engine_args(load_config(None, overrides), 0, "/models/m"))
    assert used - fields == set()


def test_start_failure_hint_points_the_right_way_per_device():
    gpu = load_config(None, GPU)
    small = start_failure_hint(gpu, "ValueError: No available memory for the cache blocks. Try increasing ...")
    assert "raise it" in small and "rollout.gpu_memory_utilization=0.85" in small
    long = start_failure_hint(gpu, "To serve at least one request with the model's max seq len (32768), (3.5 GiB KV "
                                   "cache is needed, which is larger than the available KV cache memory")
    assert "raise it" in long
    taken = start_failure_hint(gpu, "Free memory on device cuda:0 (20.1/79.2 GiB) on startup is less than desired "
                                    "GPU memory utilization (0.85, 67.3 GiB)")
    assert "lower rollout.gpu_memory_utilization=0.85" in taken and "nvidia-smi" in taken
    # on CPU the KV cache is cpu_kvcache_gib: a cache too small for the context is fixed by raising that
    cpu = load_config(None, [])
    assert "raise rollout.cpu_kvcache_gib=1" in start_failure_hint(cpu, "No available memory for the cache blocks")
    assert "lower rollout.gpu_memory_utilization=0.1" in start_failure_hint(cpu, "Cannot allocate memory")


# --- a GPU role without CUDA ------------------------------------------------------------------------------------
def test_gpu_role_without_cuda_raises_naming_the_cuda_build_and_the_driver():
    assert require_cuda(False, "learner rank 0", cuda_available=False) is False
    assert require_cuda(True, "learner rank 0", cuda_available=True) is True
    with pytest.raises(RuntimeError) as err:
        require_cuda(True, "learner rank 0", cuda_available=False)
    message = str(err.value)
    assert message.startswith("cluster.use_gpus=true, but learner rank 0 cannot use CUDA: "
                              "torch.cuda.is_available() is False")
    assert "torch.version.cuda" in message and "driver: " in message and "nvidia-smi" in message
    assert "driver 580 or newer" in message and "cluster.use_gpus=false" in message


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks a CPU-only build of torch")
def test_tensor_parallel_engine_actor_without_a_cuda_build_raises_too():
    # the actor of a TP > 1 engine holds no GPU (its vLLM workers do): it checks torch's build and the driver
    with pytest.raises(RuntimeError) as err:
        require_cuda(True, "rollout worker 1", holds_gpu=False)
    message = str(err.value)
    assert message.startswith("cluster.use_gpus=true, but rollout worker 1 cannot use CUDA: its engine's workers "
                              "need a CUDA build of torch and a loaded NVIDIA driver")
    assert f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)" in message
    assert require_cuda(False, "rollout worker 1", holds_gpu=False) is False


@NO_CUDA
def test_learner_rank_and_reference_worker_refuse_gpus_they_cannot_use(monkeypatch):
    from actors.reference_worker import ReferenceWorker

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    cfg = load_config(None, [*GPU, "algorithm.preset=grpo", "reference.num_workers=1"])
    with pytest.raises(RuntimeError, match="cluster.use_gpus=true, but DeepSpeedRank 0 cannot use CUDA"):
        DeepSpeedRank(cfg, 0, 1, "/models/m")
    assert "DS_ACCELERATOR" not in os.environ  # never switched to CPU on the way
    # refused before the model folder is read (the path does not exist)
    with pytest.raises(RuntimeError, match="cluster.use_gpus=true, but reference worker 0 cannot use CUDA"):
        ReferenceWorker(cfg, 0, "/models/none")
    # without cluster.use_gpus the rank runs on CPU, as before
    assert DeepSpeedRank(load_config(None, []), 0, 1, "/models/m").use_cuda is False
    assert os.environ["DS_ACCELERATOR"] == "cpu"


# --- what each actor sees of the node's GPUs ----------------------------------------------------------------------
def _placement_options(overrides: list[str]) -> dict[str, dict]:
    cfg = load_config(None, [*overrides, "algorithm.preset=grpo", "reference.num_workers=1", "reference.gpus=0.5"])
    plan = plan_placement(cfg)
    placement = Placement(plan, {r.role: [PlacementGroup.empty() for _ in plan.groups(r.role)] for r in plan.roles})
    out = {}
    for role in ("rollout", "learner", "reward", "reference"):
        options = placement.options(role, 0)
        options.pop("scheduling_strategy")
        out[role] = options
    return out


def test_actors_without_a_gpu_see_none_but_a_tensor_parallel_engine():
    hidden = {"runtime_env": {"env_vars": {"CUDA_VISIBLE_DEVICES": ""}}}
    tp1 = _placement_options(GPU)
    assert tp1["rollout"] == {"num_cpus": 1.0, "num_gpus": 1.0}  # Ray sets its GPU
    assert tp1["learner"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert tp1["reference"] == {"num_cpus": 1.0, "num_gpus": 0.5}  # a fraction is a GPU id too
    assert tp1["reward"] == {"num_cpus": 0.5, "num_gpus": 0.0, **hidden}
    # TP 2: the engine's actor holds no GPU, but its vLLM Ray workers take its runtime_env and hold one each
    tp2 = _placement_options([*GPU, "rollout.tensor_parallel_size=2"])
    assert tp2["rollout"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    # a CPU run on a node with GPUs: no actor may open a CUDA context there
    cpu = _placement_options(["rollout.tensor_parallel_size=2"])
    assert all(options["runtime_env"] == hidden["runtime_env"] for options in cpu.values())


def test_actors_outside_the_placement_hide_gpus_too():
    cfg = load_config(None, [])
    assert reward_options(cfg)["runtime_env"] == {"env_vars": HIDDEN_GPUS}
    assert rollout_options(cfg)["runtime_env"] == {"env_vars": HIDDEN_GPUS}
    assert critic_options(cfg, None, 0)["runtime_env"] == {"env_vars": HIDDEN_GPUS}
    assert "runtime_env" not in rollout_options(load_config(None, [*GPU, "rollout.tensor_parallel_size=2"]))
    # a rank's own environment is added to the hidden GPUs, not put in their place
    assert with_env(reward_options(cfg), {"TORCHDYNAMO_DISABLE": "1"})["runtime_env"] == {
        "env_vars": {"CUDA_VISIBLE_DEVICES": "", "TORCHDYNAMO_DISABLE": "1"}}


def _env(*names: str) -> list[str | None]:
    return [os.environ.get(name) for name in names]


@pytest.mark.slow
def test_a_gpu_less_actor_sees_no_gpu_and_keeps_the_jobs_environment(ray_cluster):
    # Ray merges a task's or actor's env_vars into the job's (tests/conftest.py sets VLLM_ENABLE_V1_MULTIPROCESSING
    # there), so hiding the GPUs takes nothing else away; a rank's own variables are added beside it
    options = with_env(reward_options(load_config(None, [])), {"TORCHDYNAMO_DISABLE": "1"})
    probe = ray_cluster.remote(_env).options(**options)
    names = ("CUDA_VISIBLE_DEVICES", "VLLM_ENABLE_V1_MULTIPROCESSING", "TORCHDYNAMO_DISABLE")
    assert ray_cluster.get(probe.remote(*names)) == ["", "0", "1"]


# --- device-aware defaults --------------------------------------------------------------------------------------
def test_cpu_defaults_are_unchanged():
    cfg = load_config(None, [])
    assert (cfg.model.dtype, cfg.rollout.gpu_memory_utilization, cfg.rollout.enforce_eager) == ("float32", 0.1, True)
    assert cfg.weight_sync.verify_tolerance is None and cfg.weight_sync.check_tolerance(cfg.model.dtype) == 1e-3


def test_gpu_defaults_fill_only_what_the_user_left_unset():
    cfg = load_config(None, GPU)
    assert (cfg.model.dtype, cfg.rollout.gpu_memory_utilization, cfg.rollout.enforce_eager) == \
           ("bfloat16", 0.85, False)
    kept = load_config(None, [*GPU, "model.dtype=float32", "rollout.gpu_memory_utilization=0.5",
                              "rollout.enforce_eager=true"])
    assert (kept.model.dtype, kept.rollout.gpu_memory_utilization, kept.rollout.enforce_eager) == ("float32", 0.5, True)
    # the run folder's config.yaml says what ran, and loads back to the same config
    saved = yaml.safe_load(dump_config(cfg))
    assert (saved["model"]["dtype"], saved["rollout"]["gpu_memory_utilization"]) == ("bfloat16", 0.85)
    assert RunConfig.model_validate(saved) == cfg


@pytest.mark.parametrize("tp", [1, 2])
def test_the_collective_transport_on_gpus_is_refused_at_load_naming_the_fix(tp):
    with pytest.raises(ValueError, match="weight_sync.type=collective with cluster.use_gpus=true") as err:
        load_config(None, [*GPU, "weight_sync.type=collective", f"rollout.tensor_parallel_size={tp}"])
    assert "Set weight_sync.type=object_store" in str(err.value) and f"tensor_parallel_size={tp}" in str(err.value)
    assert load_config(None, [*GPU, f"rollout.tensor_parallel_size={tp}"]).weight_sync.type == "object_store"
    assert load_config(None, ["weight_sync.type=collective"]).weight_sync.type == "collective"  # CPU: unchanged


def test_sync_tolerance_depends_on_dtype_and_device_and_its_stop_names_the_setting():
    assert WeightCheck(load_config(None, GPU), vocab_size=15, context_tokens=64).tolerance == GPU_16BIT_SYNC_TOLERANCE
    assert WeightCheck(load_config(None, ["model.dtype=bfloat16"]), 15, 64).tolerance == 0.5  # CPU, bf16
    assert WeightCheck(load_config(None, [*GPU, "model.dtype=float32"]), 15, 64).tolerance == 1e-3
    assert WeightCheck(load_config(None, [*GPU, "weight_sync.verify_tolerance=0.3"]), 15, 64).tolerance == 0.3
    # a null tolerance means "pick by dtype": on GPUs in bf16 that is the GPU value
    assert load_config(None, [*GPU, "weight_sync.verify_tolerance=null"]).weight_sync.verify_tolerance == 2.0
    # a gap of 0.8 nats, within the GPU tolerance, passes; 2.5 stops the run naming the setting in force
    check = WeightCheck(load_config(None, GPU), vocab_size=15, context_tokens=64)
    rows = [[-1.0] * 12 for _ in range(4)]
    check.record_learner(1, rows)
    check.record_learner(2, rows)
    gapped = [[-1.8] + [-1.0] * 11] + rows[1:]
    assert check.compare(0, [{"version": 1, "digest": check.probe.digest, "logprobs": gapped}])[0].max_gap == \
           pytest.approx(0.8)
    far = [[-3.5] + [-1.0] * 11] + rows[1:]
    with pytest.raises(WeightSyncMismatch, match=r"above the tolerance 2 \(weight_sync.verify_tolerance=2.0\).*"
                                                 r"raise weight_sync.verify_tolerance"):
        check.compare(0, [{"version": 2, "digest": check.probe.digest, "logprobs": far}])
