"""Shared fixtures for the real-stack tests: one local Ray per session and tiny model folders built locally."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """`../shared` beside the repository (GSM8K lives there), or $RELAYRL_SHARED_DIR."""
    return Path(os.environ.get("RELAYRL_SHARED_DIR", REPO.parent / "shared"))


TEST_ENV_VARS = {"DS_ACCELERATOR": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""Environment of every test actor (besides cluster.ray_setup.QUIET_ENV)."""


def start_test_ray() -> None:
    """The session's local Ray (8 logical CPUs). Tests that need another cluster shut it down and call this
    again when they are done, so the tests after them find it as before."""
    import ray

    from cluster.ray_setup import QUIET_ENV

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {**QUIET_ENV, **TEST_ENV_VARS}})


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    start_test_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Random-init Qwen2 folders with the demo tokenizer: {"tied": path, "untied": path}."""
    from cluster.demo_model import build_random_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: build_random_model(root / name, tied=(name == "tied"), seed=1) for name in ("tied", "untied")}
