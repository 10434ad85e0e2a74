"""Starting or joining Ray, and the Ray options each actor group is started with.

Locally (no `cluster.address`) an embedded Ray starts on this machine with logical CPUs to spare, so that
actors take fractions of the cores. Inside a submitted Ray job (`RAY_ADDRESS` set) the run joins that cluster.
Every actor runs in its bundle of the run's placement groups (cluster/placement.py).
"""

import os

import ray

from cluster.placement import Placement, gpu_visibility
from protocols.config import RunConfig
from protocols.trajectory import TOKEN_SCORERS


# vLLM logs every in-place weight reload at INFO/WARNING, and transformers draws a progress bar per load: at one
# sync per step that buries the training progress bar.
QUIET_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_DEDUP_LOGS": "1"}


def driver_log_level() -> dict[str, str]:
    """The VLLM_LOGGING_LEVEL the driver was started with, which overrides QUIET_ENV's in every actor: a first GPU
    run (deploy/gpu_smoke.sh) asks for vLLM's INFO lines (attention backend, KV cache, CUDA graphs)."""
    level = os.environ.get("VLLM_LOGGING_LEVEL", "")
    return {"VLLM_LOGGING_LEVEL": level} if level else {}


def start_ray(cfg: RunConfig) -> None:
    """Start the embedded cluster or join `cluster.address`; errors say which setting to change."""
    if ray.is_initialized():
        return
    env = {**QUIET_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.cpu_kvcache_gib)}
    if not cfg.cluster.use_gpus:
        env["DS_ACCELERATOR"] = "cpu"
    env.update(driver_log_level())
    try:
        # `ray job submit` sets RAY_ADDRESS for the job's driver: join that cluster, never start a second one.
        address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
        if address:
            ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=True)
        else:
            # Logical CPUs: actors reserve fractions of them; the OS shares the real cores.
            num_cpus = cfg.cluster.num_cpus or max(8, os.cpu_count() or 1)
            ray.init(num_cpus=num_cpus, include_dashboard=cfg.cluster.include_dashboard,
                     dashboard_host=cfg.cluster.dashboard_host, runtime_env={"env_vars": env},
                     log_to_driver=True, configure_logging=True, logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as err:
        where = f"cluster.address={cfg.cluster.address!r}" if cfg.cluster.address else "the embedded local cluster"
        raise RuntimeError(
            f"Ray failed to start ({where}): {err}\nFix: check that cluster.address points at a running head "
            "node (`ray status`), or leave it empty to start locally; if memory is short, lower "
            "cluster.num_cpus or stop other Ray instances (`ray stop`)."
        ) from err


def _legacy_options(cfg: RunConfig, role: str) -> dict:
    """Resources of one actor of `role` outside any placement group (tests that start single actors)."""
    c = cfg.cluster
    if role in TOKEN_SCORERS:  # a frozen model's section: <role>.cpus, .gpus, .resources
        frozen = getattr(cfg, role)
        cpus, gpus, resources = frozen.cpus, frozen.gpus, frozen.resources
    else:
        cpus = {"rollout": c.rollout_cpus, "learner": c.learner_cpus, "reward": c.reward_cpus}[role]
        gpus = {"rollout": cfg.rollout.tensor_parallel_size, "learner": 1, "reward": 0}[role]
        resources = {"rollout": c.rollout_resources, "learner": c.learner_resources, "reward": c.reward_resources}[role]
    gpus = gpus if c.use_gpus else 0
    return {"num_cpus": cpus, "num_gpus": gpus, **({"resources": dict(resources)} if resources else {}),
            **gpu_visibility(gpus)}


def rollout_options(cfg: RunConfig, placement: Placement | None = None, index: int = 0) -> dict:
    """Ray options for rollout engine `index`: its bundle of the run's placement (see cluster/placement.py)."""
    return placement.options("rollout", index) if placement else _legacy_options(cfg, "rollout")


def learner_options(cfg: RunConfig, placement: Placement | None = None, index: int = 0) -> dict:
    """Ray options for learner rank `index`: its bundle of the run's placement."""
    return placement.options("learner", index) if placement else _legacy_options(cfg, "learner")


def reward_options(cfg: RunConfig, placement: Placement | None = None, index: int = 0) -> dict:
    """Ray options for reward worker `index`: its bundle of the run's placement."""
    return placement.options("reward", index) if placement else _legacy_options(cfg, "reward")


def token_scorer_options(cfg: RunConfig, role: str, placement: Placement | None = None, index: int = 0) -> dict:
    """Ray options for worker `index` of a frozen token-scoring role (protocols.trajectory.TOKEN_SCORERS:
    reference, teacher): its bundle of the run's placement."""
    return placement.options(role, index) if placement else _legacy_options(cfg, role)
