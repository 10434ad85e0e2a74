"""Starting or joining Ray, and the resources each actor group asks for.

Locally (no `cluster.address`) an embedded Ray starts on this machine with logical CPUs to spare, so that
actors take fractions of the cores; on a cluster, GPUs are requested per vLLM engine and per learner rank.
"""

import os

import ray

from protocols.config import RunConfig


# vLLM logs every in-place weight reload at INFO/WARNING, and transformers draws a progress bar per load: at one
# sync per step that buries the training progress bar.
QUIET_ENV = {"TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_DEDUP_LOGS": "1"}


def start_ray(cfg: RunConfig) -> None:
    """Start the embedded cluster or join `cluster.address`; errors say which setting to change."""
    if ray.is_initialized():
        return
    env = {**QUIET_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.cpu_kvcache_gib)}
    if not cfg.cluster.use_gpus:
        env["DS_ACCELERATOR"] = "cpu"
    try:
        if cfg.cluster.address:
            ray.init(address=cfg.cluster.address, runtime_env={"env_vars": env}, log_to_driver=True)
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


def rollout_options(cfg: RunConfig) -> dict:
    if cfg.cluster.use_gpus:
        return {"num_cpus": 1, "num_gpus": cfg.rollout.tensor_parallel_size}
    return {"num_cpus": 1}


def learner_options(cfg: RunConfig) -> dict:
    if cfg.cluster.use_gpus:
        return {"num_cpus": 1, "num_gpus": 1}
    return {"num_cpus": 1}


def reward_options(cfg: RunConfig) -> dict:
    return {"num_cpus": 0.5}
