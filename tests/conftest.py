"""Shared fixtures for the real-stack tests: one local Ray per session and tiny model folders built locally; and the
order of a run: pure tests first, then the real-stack (slow) ones, those that replace the session's Ray last."""

import os
from concurrent.futures import ThreadPoolExecutor, wait
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


def record_batches(trainer) -> list[tuple[int, list]]:
    """Wrap `trainer.step` so that each step first records (the policy version it trains at, its groups); the
    list fills as the run goes."""
    trained: list[tuple[int, list]] = []
    step = trainer.step

    def recording_step(groups):
        trained.append((trainer.version, groups))
        return step(groups)

    trainer.step = recording_step
    return trained


def at_once(*calls: tuple) -> list:
    """Results of `calls`, each `(function, *args)`, run in threads at the same time. For tests that start
    several independent actor groups (DeepSpeed groups, engines): a start is mostly imports and waits, so the
    starts overlap instead of adding up. Each call must clean up after itself; the first error is raised once
    all have ended."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(function, *args) for function, *args in calls]
        return [future.result() for future in futures]


def start_together(*factories) -> list:
    """The objects `factories` (callables without arguments, each starting an actor group: a LearnerGroup, a
    CriticGroup, ...) return, built in threads at the same time, as at_once runs calls. If one start fails, the
    groups that did start are shut down (they hold placement bundles later tests need) before its error is
    raised."""
    with ThreadPoolExecutor(len(factories)) as pool:
        futures = [pool.submit(factory) for factory in factories]
        wait(futures)
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        for future in futures:
            if future.exception() is None:
                future.result().shutdown()
        raise failed[0]
    return [future.result() for future in futures]


TEST_ENV_VARS = {"DS_ACCELERATOR": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""Environment of every test actor (besides cluster.ray_setup.QUIET_ENV)."""


def start_test_ray() -> None:
    """The session's local Ray (8 logical CPUs), started if none is connected. Tests that need another cluster
    shut it down; the next test that asks for `ray_cluster` starts it again."""
    import ray

    from cluster.ray_setup import QUIET_ENV

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING",
                 runtime_env={"env_vars": {**QUIET_ENV, **TEST_ENV_VARS}})


# Fixtures that shut the session's Ray down for a cluster of their own (tests/test_multinode.py): their tests run
# last, so the session's Ray is not started again after them for nothing.
REPLACES_SESSION_RAY = frozenset({"three_nodes"})


def pytest_collection_modifyitems(config, items):
    """Pure tests first (a failure there shows in seconds, not after the real stack's minutes), then the slow ones,
    then those that replace the session's Ray; the collection order is kept within each part (a stable sort).
    Under pytest-xdist (TEST_WORKERS=2) those come first among the slow ones instead: each module runs whole on one
    worker (--dist loadfile), minutes long, and started last they would leave the other worker idle at the end."""
    replacing_part = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 3

    def part(item) -> int:
        if item.get_closest_marker("slow") is None:
            return 0
        return replacing_part if REPLACES_SESSION_RAY & set(item.fixturenames) else 2

    items.sort(key=part)


@pytest.fixture(scope="session")
def _session_ray():
    """Shuts the session's Ray down at the end of the run."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture
def ray_cluster(_session_ray):
    """The session's local Ray: started once, then reused by every test (started again only after a module that
    replaced it with a cluster of its own)."""
    import ray

    start_test_ray()
    return ray


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Random-init Qwen2 folders with the demo tokenizer: {"tied": path, "untied": path}."""
    from demos.arithmetic_model import build_random_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {name: build_random_model(root / name, tied=(name == "tied"), seed=1) for name in ("tied", "untied")}
