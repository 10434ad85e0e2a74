"""AlgorithmConfig: presets, deep-merge overrides, YAML round trip, rejection of bad input."""

import pytest
import yaml
from pydantic import ValidationError

from protocols.algorithm import PRESETS, AlgorithmConfig, CISPOLoss, GAEAdvantage, PPOClipLoss

NAMES = ["reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce_pp", "ppo"]


def test_every_required_preset_exists():
    assert sorted(PRESETS) == sorted(NAMES)


@pytest.mark.parametrize("preset", NAMES)
def test_preset_validates_and_round_trips_through_yaml(preset):
    cfg = AlgorithmConfig(preset=preset)
    again = AlgorithmConfig.model_validate(yaml.safe_load(yaml.safe_dump(cfg.model_dump())))
    assert again == cfg and cfg.paper


@pytest.mark.parametrize("preset", NAMES)
def test_preset_sets_every_field_it_owns(preset):
    # a preset is a complete choice: the config built from it equals the preset dict on every key it lists
    dumped = AlgorithmConfig(preset=preset).model_dump()
    for key, value in PRESETS[preset].items():
        if isinstance(value, dict):
            assert {k: dumped[key][k] for k in value} == value, key
        else:
            assert dumped[key] == value, key


def test_default_is_the_runs_default_dapo():
    from protocols.config import RunConfig, load_config

    # One default for the section on its own, for a run without an algorithm section, and for a run that sets a
    # field without naming a preset.
    assert AlgorithmConfig() == AlgorithmConfig(preset="dapo") == RunConfig().algorithm
    assert AlgorithmConfig(kl={"beta": 0.0}) == load_config(None, ["algorithm.kl.beta=0"]).algorithm
    assert AlgorithmConfig().dynamic_sampling and AlgorithmConfig().aggregation == "token_mean"


def test_dapo_preset_choices():
    cfg = AlgorithmConfig(preset="dapo")
    assert cfg.policy_loss == PPOClipLoss(eps_low=0.2, eps_high=0.28)
    assert cfg.aggregation == "token_mean" and cfg.dynamic_sampling and cfg.overlong.enabled and cfg.kl.beta == 0


def test_ppo_preset_uses_gae():
    assert isinstance(AlgorithmConfig(preset="ppo").advantage, GAEAdvantage)


def test_nested_override_deep_merges_into_preset():
    # YAML `algorithm: {preset: dapo, policy_loss: {eps_high: 0.3}}` keeps DAPO's eps_low 0.2
    cfg = AlgorithmConfig.model_validate(yaml.safe_load("preset: dapo\npolicy_loss: {eps_high: 0.3}\n"))
    assert cfg.policy_loss == PPOClipLoss(eps_low=0.2, eps_high=0.3)
    assert cfg.aggregation == "token_mean"  # untouched fields still come from the preset


def test_override_with_other_type_replaces_section():
    # switching the loss type drops the preset's ppo fields (dual_clip_c would not apply to cispo)
    cfg = AlgorithmConfig(preset="dapo", policy_loss={"type": "cispo", "eps_high": 3.0})
    assert cfg.policy_loss == CISPOLoss(eps_high=3.0)


def test_top_level_override_beats_preset():
    assert AlgorithmConfig(preset="dapo", dynamic_sampling=False).dynamic_sampling is False


def test_unknown_key_is_rejected_naming_it():
    with pytest.raises(ValidationError, match="polcy_loss"):
        AlgorithmConfig(preset="grpo", polcy_loss={"eps_low": 0.1})


def test_unknown_nested_key_is_rejected_naming_it():
    with pytest.raises(ValidationError, match="eps_hgh"):
        AlgorithmConfig(policy_loss={"eps_hgh": 0.3})


def test_unknown_preset_is_rejected():
    with pytest.raises(ValidationError, match="preset"):
        AlgorithmConfig(preset="trpo")


def test_out_of_range_eps_is_rejected():
    with pytest.raises(ValidationError, match="eps_low"):
        AlgorithmConfig(policy_loss={"eps_low": 1.5})


def test_mask_bounds_must_be_ordered():
    with pytest.raises(ValidationError, match="algorithm.off_policy.mask_low=3.0 must be below mask_high=2.0"):
        AlgorithmConfig(off_policy={"mask_low": 3.0, "mask_high": 2.0})


def test_async_default_is_decoupled_with_tis_cap_two():
    for preset in NAMES:
        off = AlgorithmConfig(preset=preset).off_policy
        assert (off.mode, off.tis_cap) == ("decoupled", 2.0)


def test_every_field_has_a_description():
    # the docstring under each field becomes its description (use_attribute_docstrings)
    from protocols import algorithm

    for model in (algorithm.AlgorithmConfig, algorithm.GRPOAdvantage, algorithm.PPOClipLoss,
                  algorithm.OffPolicyConfig, algorithm.KLConfig, algorithm.OverlongConfig, algorithm.GAEAdvantage):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"
