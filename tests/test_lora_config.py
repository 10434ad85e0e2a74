"""model.lora: its defaults, and the settings refused before any actor starts, each message naming the fix."""

import pytest

from protocols.config import ConfigError, load_config
from protocols.lora import PROJECTION_MODULES, LoraConfig


def test_lora_is_off_by_default():
    cfg = load_config(None, [])
    assert cfg.model.lora.rank == 0 and not cfg.model.lora.enabled


def test_default_targets_are_the_seven_projections():
    cfg = load_config(None, ["model.lora.rank=16"])
    assert cfg.model.lora.target_modules == list(PROJECTION_MODULES)
    assert len(cfg.model.lora.target_modules) == 7


def test_engine_max_rank_defaults_to_the_smallest_vllm_value_holding_the_rank():
    # vLLM accepts 1, 8, 16, 32, ...: rank 16 -> 16, rank 12 -> 16, rank 2 -> 8, rank 1 -> 1
    assert LoraConfig(rank=16).engine_max_rank == 16
    assert LoraConfig(rank=12).engine_max_rank == 16
    assert LoraConfig(rank=2).engine_max_rank == 8
    assert LoraConfig(rank=1).engine_max_rank == 1
    assert LoraConfig(rank=8, max_lora_rank=32).engine_max_rank == 32


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens", "model.embed_tokens"])
def test_targets_vllm_cannot_serve_are_refused_with_the_fix(target):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.lora.rank=8", f"model.lora.target_modules=[q_proj, {target}]"])
    message = str(err.value)
    assert "model.lora.target_modules" in message and target in message
    assert "model.lora.target_modules=['q_proj']" in message  # the fix: the list without it


def test_max_lora_rank_below_the_rank_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.lora.rank=16", "model.lora.max_lora_rank=8"])
    message = str(err.value)
    assert "max_lora_rank=8" in message and "rank=16" in message and "16 or more" in message


def test_max_lora_rank_vllm_does_not_accept_is_refused():
    # 24 is not in vLLM's list; the next value that holds it is 32
    with pytest.raises(ConfigError, match=r"max_lora_rank=24 .* Use 32"):
        load_config(None, ["model.lora.rank=16", "model.lora.max_lora_rank=24"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_lora_on_cpu_is_refused_with_the_fix(dtype):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.lora.rank=8", f"model.dtype={dtype}"])
    assert f"model.dtype={dtype}" in str(err.value) and "model.dtype=float32" in str(err.value)


def test_16_bit_lora_on_gpus_and_16_bit_without_lora_are_allowed():
    assert load_config(None, ["model.lora.rank=8", "model.dtype=bfloat16", "cluster.use_gpus=true"]).model.lora.rank == 8
    assert load_config(None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"


def test_lora_under_sequence_parallelism_is_refused():
    with pytest.raises(ConfigError, match="sequence_parallel_size=2"):
        load_config(None, ["model.lora.rank=8", "learner.sequence_parallel_size=2", "learner.num_ranks=2"])
