"""Bad input for long chain-of-thought batches: long samples are never truncated, and none beyond the context
reaches the learner."""

import json

import pytest

from cluster.model_folder import fit_lengths_to_model
from learner.micro_batches import check_fits_context, token_budget_micro_batches
from protocols.config import load_config


def test_sample_longer_than_the_budget_is_trained_whole_alone():
    # budget 1,000: the 5,000-token sample gets micro-batch [1] to itself; 300 + 600 share one (900 <= 1,000)
    plan = token_budget_micro_batches([300, 5000, 600], 1000)
    assert plan == [[0, 2], [1]]
    plan = token_budget_micro_batches([300, 5000, 600], 1000, padded=True)
    assert sorted(map(sorted, plan)) == [[0], [1], [2]]  # padded: 2 x 600 > 1,000, so 300 and 600 split


def test_sample_beyond_the_model_context_names_the_lengths():
    with pytest.raises(ValueError, match=r"sample 1 has 9000 tokens .* context of 8192"):
        check_fits_context([100, 9000], 8192)
    check_fits_context([100, 8192], 8192)  # exactly the context fits


def test_prompt_room_shrinks_so_prompt_plus_response_fits_the_context(tmp_path):
    # context 8,192, responses up to 8,000: prompts may use 192 tokens; longer prompts are then skipped and
    # counted by the data loaders (tests/test_datasets.py), so no prompt + response exceeds the context.
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    cfg = load_config(None, ["rollout.max_response_tokens=8000", "data.max_prompt_tokens=1024"])
    assert fit_lengths_to_model(cfg, str(tmp_path)).data.max_prompt_tokens == 192
