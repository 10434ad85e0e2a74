"""The run config: defaults validate, every shipped config loads, bad keys are named before anything starts."""

from pathlib import Path

import pytest

from protocols.config import ConfigError, RunConfig, load_config, parse_overrides

REPO = Path(__file__).resolve().parents[1]


def test_defaults_validate():
    cfg = RunConfig()
    assert cfg.train.max_staleness == 1  # asynchronous by default: generation overlaps the learner step
    assert cfg.samples_per_step == cfg.learner.prompts_per_step * cfg.rollout.samples_per_prompt


@pytest.mark.parametrize("path", sorted((REPO / "deploy" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_misspelled_key_is_named_with_allowed_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("learner:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "learner.lrr" in message and "lr" in message and "micro_batch_size" in message


def test_wrong_type_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.num_workers"):
        load_config(None, ["rollout.num_workers=two"])


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match="rolout"):
        load_config(None, ["rolout.num_workers=2"])


def test_overrides_are_parsed_as_yaml():
    assert parse_overrides(["learner.lr=1e-4", "train.partial_rollouts=false"]) == [
        ("learner.lr", 1e-4), ("train.partial_rollouts", False)]
    cfg = load_config(None, ["learner.lr=1e-4", "rollout.num_workers=3"])
    assert cfg.learner.lr == 1e-4 and cfg.rollout.num_workers == 3


def test_batch_must_split_over_ranks():
    # 3 prompts * 3 samples = 9 samples cannot split over 2 ranks
    with pytest.raises(ConfigError, match="num_ranks=2"):
        load_config(None, ["learner.prompts_per_step=3", "rollout.samples_per_prompt=3", "learner.num_ranks=2"])


def test_algorithm_preset_from_the_command_line():
    cfg = load_config(None, ["algorithm.preset=dapo"])
    assert cfg.algorithm.preset == "dapo"


def test_the_session_endpoint_runs_beside_every_scoring_role():
    # session groups pass the scoring stage too, so every role may run beside the endpoint
    cfg = load_config(None, ["gateway.enabled=true", "algorithm.preset=ppo", "reference.num_workers=1",
                             "critic.num_workers=1", "teacher.path=/models/teacher", "teacher.num_workers=1"])
    assert (cfg.reference.num_workers, cfg.teacher.num_workers, cfg.critic.num_workers) == (1, 1, 1)
