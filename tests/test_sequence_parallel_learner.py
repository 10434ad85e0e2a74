"""Sequence parallelism through LearnerGroup / LearnerRank on real DeepSpeed (gloo): the same global batch on
2 ranks sharing each sample (sp 2), or 4 ranks (2 data-parallel groups x sp 2), gives the loss, metrics, log-probs
and updated weights of one rank without SP, for token_mean (dapo), seq_mean_token_mean with the KL in the loss
(grpo, reference model on the SP slices too) and GSPO with a sequence-level off-policy mask."""

import pytest
import ray
import torch

from protocols.config import load_config
from tests.conftest import at_once
from tests.test_token_budget_learner import make_batch, normalizer

pytestmark = pytest.mark.slow

# Summed over micro-batches, slices and ranks, then compared: per-token sums (clip_frac, kl, entropy, ratio, ...)
# and the counts.
COMPARED = ("loss", "pg_loss", "num_tokens", "num_sequences", "clip_frac", "ratio", "entropy", "kl", "is_masked",
            "is_weight")


# Results of run_one_step per (model folder, preset, overrides): a pure function of them, read only by the tests.
# test_sequence_parallel_updates compares against the same one-rank grpo run as test_two_sp_ranks_match_one_rank,
# so that DeepSpeed group starts once per session.
_RUNS: dict[tuple, tuple[dict, dict]] = {}


def run_one_step(model_path: str, preset: str, overrides: list[str]) -> tuple[dict, dict]:
    key = (model_path, preset, tuple(overrides))
    if key not in _RUNS:
        _RUNS[key] = _run_one_step(model_path, preset, overrides)
    return _RUNS[key]


def _run_one_step(model_path: str, preset: str, overrides: list[str]) -> tuple[dict, dict]:
    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, ["learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "learner.lr=1e-3",
                             f"algorithm.preset={preset}", "rollout.max_response_tokens=16",
                             "algorithm.entropy_coef=0.01", *overrides])
    # Responses of 1 to 12 tokens behind prompts of 2 to 5; sample 5 masked out (counts in no normalizer).
    batch = make_batch(8, 12, 3)
    group = LearnerGroup(cfg, model_path)
    try:
        metrics = group.train_step(batch, normalizer(batch))
        if preset == "grpo":  # a second step, where policy and reference differ: the KL term has a gradient
            second = make_batch(8, 12, 5)
            metrics = {"first_loss": metrics["loss"], **group.train_step(second, normalizer(second))}
        scores = {"policy": group.policy_logprobs(make_batch(8, 9, 4))}
        if preset == "grpo":  # the in-learner reference model (KL in the loss)
            scores["ref"] = group.ref_logprobs(make_batch(8, 9, 4))
        packed = ray.get(group.publish_weights().refs[0])
    finally:
        group.shutdown()
    scores["weights"] = {k: torch.from_numpy(v.copy()) for k, (_, v) in packed.items()}
    return metrics, scores


def assert_same_step(name: str, got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    (metrics, out), (base, base_out) = got, want
    assert metrics["loss"] == pytest.approx(base["loss"], rel=1e-5, abs=1e-7), name
    if "first_loss" in base:
        assert metrics["first_loss"] == pytest.approx(base["first_loss"], rel=1e-5, abs=1e-7), name
        assert base["kl"] > 1e-6, "the second step's policy has moved away from the reference"
    assert metrics["grad_norm_max"] == pytest.approx(base["grad_norm_max"], rel=1e-4), name
    for key in COMPARED:
        if key in base:
            assert metrics[key] == pytest.approx(base[key], rel=1e-5, abs=1e-6), (name, key)
    # 7 kept samples; counted once each although two ranks hold slices of them
    assert metrics["num_sequences"] == base["num_sequences"] == 7, name
    assert metrics["learner/real_tokens"] == base["learner/real_tokens"], name
    # As in test_learner_sharding: Adam's first step moves weights by ~lr = 1e-3; 2% of it absorbs float noise in
    # the sign of near-zero gradients, a wrong scale or normalizer would be off by a whole step.
    atol = 4e-5 if "first_loss" in base else 2e-5  # per Adam step
    for key, tensor in base_out["weights"].items():
        torch.testing.assert_close(out["weights"][key], tensor, rtol=0, atol=atol, msg=f"{name} {key}")
    for kind in ("policy", "ref"):
        if kind in base_out:
            torch.testing.assert_close(out[kind], base_out[kind], rtol=0, atol=1e-4, msg=f"{name} {kind}")


# GSPO's sequence ratio and the sequence-level off-policy mask need whole samples: summed over the SP group. The
# band is widened from the preset's 3e-4 so that sequences are not all clipped (and all gradients zero).
GSPO = ["algorithm.policy_loss.eps_low=0.5", "algorithm.policy_loss.eps_high=0.5",
        "algorithm.off_policy.mask_level=sequence", "algorithm.off_policy.mask_low=0.7"]


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
def test_two_sp_ranks_match_one_rank(ray_cluster, tiny_models, preset):
    path = tiny_models["untied"]
    # One rank, the same packed micro-batches of at most 16 tokens and the same chunked LM head: all that differs
    # is that two ranks each hold half of every row (slices cut samples, some hold no response token at all).
    # (Against one padded micro-batch with full logits, Adam's sign noise on near-zero gradients reaches 3e-5,
    # padding and chunking alone: test_token_budget_learner compares those paths.)
    common = ["learner.max_tokens_per_micro_batch=16", "learner.packing=true", "learner.logits_chunk_tokens=5",
              *(GSPO if preset == "gspo" else [])]
    # the two groups run at once (a start is mostly imports and waits)
    base, sp = at_once((run_one_step, path, preset, common),
                       (run_one_step, path, preset, ["learner.num_ranks=2", "learner.sequence_parallel_size=2",
                                                     *common]))
    if preset == "gspo":  # the sequence mask drops some samples' tokens, not all
        assert 0 < base[0]["is_masked"] < base[0]["num_tokens"], base[0]
    assert sp[0]["learner/micro_batches_max"] == base[0]["learner/micro_batches_max"] > 1
    # each slice runs half of each row: the processed positions add up to the rows, padded to a multiple of 2
    assert base[0]["learner/processed_tokens"] <= sp[0]["learner/processed_tokens"] <= (
        base[0]["learner/processed_tokens"] + sp[0]["learner/micro_batches_max"])
    assert_same_step(f"{preset} sp2", sp, base)


def test_two_data_parallel_groups_of_two_sp_ranks_match_one_rank(ray_cluster, tiny_models):
    path = tiny_models["tied"]
    common = ["learner.max_tokens_per_micro_batch=16", "learner.packing=true", "learner.logits_chunk_tokens=5"]
    # with gradient checkpointing: the recomputed forward runs the attention all-to-alls again, on every rank
    # Against 2 plain data-parallel ranks (the same split of samples over the 2 groups, the same micro-batches),
    # and against one rank (other micro-batches: each group plans its own). The three groups run at once.
    got, *bases = at_once((run_one_step, path, "grpo", ["learner.num_ranks=4", "learner.sequence_parallel_size=2",
                                                        "learner.gradient_checkpointing=true", *common]),
                          *[(run_one_step, path, "grpo", [f"learner.num_ranks={ranks}", *common]) for ranks in (2, 1)])
    for name, base in zip(("dp2", "one rank"), bases):
        assert_same_step(f"grpo dp2 x sp2 vs {name}", got, base)
