"""The critic: clipped value loss arithmetic, the real DeepSpeed critic fitting a fixed batch, GAE over its real
values against a hand computation, and the config / model-folder checks that run before any actor starts."""

import json
import shutil

import pytest
import torch

from learner.value_loss import clipped_value_loss
from protocols.config import ConfigError, load_config
from protocols.training_batch import TrainingBatch


# ------------------------------------------------------------------------------------------------ pure maths


def test_clipped_value_loss_by_hand():
    # one sample, three tokens, clip 0.2, returns R = [1, 1, 1], old values V_old = [0, 0, 0.9]
    values = torch.tensor([[0.5, -0.1, 1.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.9]])
    returns = torch.ones(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = clipped_value_loss(values, old, returns, mask, clip=0.2, num_tokens=3)
    # token 0: V=0.5, V_clip = 0 + clip(0.5, +-0.2) = 0.2; errors (0.5-1)^2 = 0.25, (0.2-1)^2 = 0.64 -> 0.32
    # token 1: V=-0.1 moved away from R, V_clip = -0.1; both errors (1.1)^2 = 1.21 -> 0.605
    # token 2: V=1.0, V_clip = 0.9 + 0.1 = 1.0; both 0 -> 0
    # mean over 3 tokens: (0.32 + 0.605 + 0) / 3 = 0.308333...
    assert loss.item() == pytest.approx((0.32 + 0.605) / 3)
    assert m["value_clip_frac"] == 1.0  # only token 0's clipped error is strictly larger
    loss.backward()
    # token 0 is clipped: its gradient is 0; token 1: d/dV 0.5 (V-R)^2 / 3 = (-0.1 - 1) / 3; token 2: 0
    assert values.grad.tolist()[0] == pytest.approx([0.0, -1.1 / 3, 0.0])
    plain, _ = clipped_value_loss(values, old, returns, mask, clip=None, num_tokens=3)
    # unclipped: (0.25 + 1.21 + 0) / 2 / 3
    assert plain.item() == pytest.approx((0.25 + 1.21) / 6)


def test_clipped_value_loss_parts_add_up_to_the_global_mean():
    g = torch.Generator().manual_seed(0)
    values, old, returns = (torch.randn(4, 5, generator=g) for _ in range(3))
    mask = torch.rand(4, 5, generator=g) > 0.3
    n = float(mask.sum())
    whole, _ = clipped_value_loss(values, old, returns, mask, 0.2, n)
    parts = sum(clipped_value_loss(values[i:i + 1], old[i:i + 1], returns[i:i + 1], mask[i:i + 1], 0.2, n)[0]
                for i in range(4))
    assert float(parts) == pytest.approx(float(whole), rel=1e-6)


# ------------------------------------------------------------------------------------------ config checks


def test_ppo_without_a_critic_is_refused_naming_the_critic_settings():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.preset=ppo"])
    for name in ("algorithm.preset='ppo'", "critic.num_workers=0", "critic.num_workers=1", "critic.model_path",
                 "critic.lr"):
        assert name in str(err.value), name
    assert load_config(None, ["algorithm.preset=ppo", "critic.num_workers=1"]).critic.num_workers == 1


def test_a_critic_without_gae_is_refused():
    with pytest.raises(ConfigError, match=r"critic.num_workers=1 but algorithm.advantage.type='grpo'"):
        load_config(None, ["algorithm.preset=grpo", "critic.num_workers=1"])


def test_critic_folder_with_another_vocabulary_is_refused_naming_both_paths(tiny_models, tmp_path):
    from cluster.critic_group import check_critic_model

    policy = tiny_models["untied"]
    check_critic_model(policy, tiny_models["tied"])  # same demo tokenizer, same vocabulary: accepted
    swapped = tmp_path / "swapped_tokens"
    shutil.copytree(policy, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # same size, two ids exchanged
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError) as err:
        check_critic_model(policy, str(swapped))
    assert str(swapped) in str(err.value) and policy in str(err.value)
    assert "different ids" in str(err.value)
    bigger = tmp_path / "bigger_vocab"
    shutil.copytree(policy, bigger)
    config = json.loads((bigger / "config.json").read_text())
    config["vocab_size"] += 1
    (bigger / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        check_critic_model(policy, str(bigger))
    assert str(bigger) in str(err.value) and policy in str(err.value) and "vocab_size" in str(err.value)
    with pytest.raises(ValueError, match="not a Hugging Face model folder"):
        check_critic_model(policy, str(tmp_path))


# ------------------------------------------------------------------------------ the real DeepSpeed critic


def fixed_batch() -> TrainingBatch:
    """8 addition prompts; responses of 2-5 tokens; samples with an even index are 'correct': Monte-Carlo returns
    of reward 1 or 0 at every token (gamma = lambda = 1, no KL) are the critic's targets."""
    prompts = [[1, 3 + i % 10, 13, 3 + (i * 7) % 10, 14] for i in range(8)]
    responses = [[3 + (i + k) % 10 for k in range(1 + i % 4)] + [2] for i in range(8)]
    returns = [[float(i % 2 == 0)] * len(r) for i, r in enumerate(responses)]
    return TrainingBatch.from_samples(prompts, responses, returns=returns)


def update(group) -> None:
    """One critic update with fresh old values, as the step computes them (CriticPool.score_batch)."""
    batch = fixed_batch()
    old, _ = group.values(batch)
    group.train_step(batch.with_fields(values=old))


def critic_config(*overrides: str):
    return load_config(None, ["algorithm.preset=ppo", "critic.num_workers=2", "critic.micro_batch_size=3",
                              *overrides])


@pytest.mark.slow
def test_real_critic_value_loss_falls_on_a_fixed_batch(ray_cluster, tiny_models):
    from cluster.critic_group import CriticGroup

    cfg = critic_config("critic.lr=3e-3", "critic.warmup_steps=2")
    batch = fixed_batch()
    group = CriticGroup(cfg, tiny_models["untied"])
    try:
        losses, versions = [], []
        for _ in range(12):
            old, version = group.values(batch)  # fresh old values, as the step computes them
            versions.append(version)
            metrics = group.train_step(batch.with_fields(values=old))
            losses.append(metrics["critic/value_loss"])
        final = batch.per_sample_rows(group.values(batch)[0])
    finally:
        group.shutdown()
    # the zero-initialized head starts every value at 0: loss = mean over tokens of 1/2 R^2
    tokens = batch.response_lengths.tolist()
    first = 0.5 * sum(t for i, t in enumerate(tokens) if i % 2 == 0) / sum(tokens)
    assert losses[0] == pytest.approx(first, rel=1e-5)
    assert versions == list(range(12))  # one critic version per update, stamped on the values
    assert losses[-1] < 0.25 * losses[0], losses
    assert metrics["critic/lr"] == pytest.approx(3e-3)  # warm-up over
    assert metrics["critic/explained_variance"] > 0.5, metrics
    # and the values separate the two kinds of sample
    correct = [v for i, row in enumerate(final) if i % 2 == 0 for v in row]
    wrong = [v for i, row in enumerate(final) if i % 2 for v in row]
    assert sum(correct) / len(correct) > sum(wrong) / len(wrong) + 0.5


class HangingCriticRank:
    """A critic rank stand-in (no model) whose values and saves outlast any limit, as a rank stuck in a collective."""

    def __init__(self, cfg, rank: int, world_size: int, model_path: str) -> None:
        self.rank = rank

    def values(self, shard, plan=None):
        __import__("time").sleep(60)

    def ping(self) -> int:
        return self.rank


@pytest.mark.slow
def test_a_critic_call_past_fault_learner_timeout_s_raises_naming_it(ray_cluster):
    """The driver's waits on the critic's ranks are bounded by the learner's setting, as the learner group's are."""
    import time

    from cluster.critic_group import CriticGroup
    from cluster.rank_group import RankGroup

    cfg = critic_config("fault.learner_timeout_s=0.5")
    group = CriticGroup.__new__(CriticGroup)  # the group's wiring over stand-in ranks: no model, no DeepSpeed
    group.cfg = cfg
    group.group = RankGroup(HangingCriticRank, "critic", cfg, "", [{"num_cpus": 0}] * 2, join=False)
    group.ranks = group.group.ranks
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"a values pass did not finish on every critic rank within "
                                               r"fault.learner_timeout_s=0.5"):
            group.values(fixed_batch())
        # 0.5 s, then at most dead_ranks' 5 s ping (a busy rank answers late and counts as alive)
        assert time.monotonic() - t0 < 10
    finally:
        group.group.shutdown()


@pytest.mark.slow
def test_gae_over_real_critic_values_matches_a_hand_computation(ray_cluster, tiny_models):
    from cluster.critic_group import CriticGroup
    from learner.prepare import critic_returns
    from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup

    # a random head so the initial values are not all 0; no whitening so the advantages can be checked by hand
    cfg = critic_config("critic.num_workers=1", "critic.head_init_std=0.5", "algorithm.advantage.whiten=false",
                        "algorithm.kl.beta=0")
    prompt = Prompt(prompt_id="demo/test/0", prompt_token_ids=[1, 4, 13, 5, 14], answer="5")
    responses = [[8, 2], [8, 3, 2]]
    group = TrajectoryGroup(group_id="g0", trajectories=[
        Trajectory(group_id="g0", sample_index=i, prompt=prompt, response_token_ids=r,
                   behavior_logprobs=[-1.0] * len(r), token_versions=[0] * len(r), finish_reason="stop",
                   reward=float(i == 0))
        for i, r in enumerate(responses)])
    batch = TrainingBatch.from_trajectories(group.trajectories)
    critic = CriticGroup(cfg, tiny_models["untied"])
    try:
        values, version = critic.values(batch)  # as the step's CriticPool.score_batch asks, before the update
    finally:
        critic.shutdown()
    assert version == 0
    batch = batch.with_fields(values=values)
    v0, v1 = batch.per_sample_rows(values)
    assert len(v0) == 2 and len(v1) == 3
    # causal: V before token k depends on the prefix only, and both responses start with token 8
    assert v0[0] == pytest.approx(v1[0], abs=1e-5)
    assert len({round(v, 4) for v in v1}) == 3  # a random head gives distinct values
    rewards = torch.tensor([1.0, 0.0])
    returns = critic_returns(batch, rewards, cfg, kl=None)
    from learner.objective import compute_advantages

    adv = compute_advantages(rewards, batch.loss_mask, 2, cfg.algorithm, values=batch.values)
    lam = 0.95  # gamma = 1: delta_t = r_t + V_{t+1} - V_t, V = 0 after the last token, r = R on the last token
    a, b = v0
    # sample 0 (R = 1): A_1 = 1 - b; A_0 = (b - a) + lam * A_1
    hand0 = [(b - a) + lam * (1 - b), 1 - b]
    x, y, z = v1
    # sample 1 (R = 0): A_2 = 0 - z; A_1 = (z - y) + lam * A_2; A_0 = (y - x) + lam * A_1
    a2 = -z
    a1 = (z - y) + lam * a2
    hand1 = [(y - x) + lam * a1, a1, a2]
    assert adv[0, :2].tolist() == pytest.approx(hand0, abs=1e-6) and float(adv[0, 2]) == 0.0
    assert adv[1].tolist() == pytest.approx(hand1, abs=1e-6)
    # the critic's targets are A + V (before whitening)
    assert returns[0, :2].tolist() == pytest.approx([hand0[0] + a, hand0[1] + b], abs=1e-6)
    assert returns[1].tolist() == pytest.approx([hand1[0] + x, hand1[1] + y, hand1[2] + z], abs=1e-6)


@pytest.mark.slow
def test_a_restored_critic_continues_as_if_never_stopped(ray_cluster, tiny_models, tmp_path):
    """--resume's critic piece: weights, Adam moments, warm-up position and version come back from the DeepSpeed
    checkpoint, so the next update gives the values an uninterrupted critic gives."""
    from cluster.critic_group import CriticGroup

    cfg = critic_config("critic.lr=3e-3", "critic.warmup_steps=4")
    batch = fixed_batch()
    group = CriticGroup(cfg, tiny_models["untied"])
    try:
        update(group)
        update(group)
        assert group.save_state(str(tmp_path)) == 2
        update(group)  # the third update, mid warm-up (lr 3e-3 * 3 / 4)
        want, want_version = group.values(batch)
    finally:
        group.shutdown()
    restored = CriticGroup(cfg, tiny_models["untied"])
    try:
        assert restored.load_state(str(tmp_path)) == 2
        update(restored)
        got, got_version = restored.values(batch)
    finally:
        restored.shutdown()
    assert got_version == want_version == 3
    for got_row, want_row in zip(batch.per_sample_rows(got), batch.per_sample_rows(want)):
        assert got_row == pytest.approx(want_row, abs=1e-6)


@pytest.mark.slow
def test_a_restarted_critic_group_takes_the_newest_weights_there_are(ray_cluster, tiny_models, tmp_path):
    """A dead rank restarts the group from a survivor's full weights (ZeRO-2), else the newest checkpoint's
    critic, else the initial weights; the version never goes back and the new group trains (its collectives
    work)."""
    import time

    import ray

    from cluster import checkpoint
    from cluster.critic_group import CriticGroup

    cfg = critic_config("critic.lr=3e-3", "critic.warmup_steps=0", f"output_dir={tmp_path / 'run'}")
    batch = fixed_batch()

    def flat(values: torch.Tensor) -> list[float]:
        return [v for row in batch.per_sample_rows(values) for v in row]

    def kill_and_find(group: CriticGroup, ranks: list[int]) -> int:
        for r in ranks:
            ray.kill(group.ranks[r])
        deadline = time.monotonic() + 60
        while (lost := group.dead_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lost is not None and lost[0] in ranks
        return lost[0]

    group = CriticGroup(cfg, tiny_models["untied"])
    try:
        update(group)
        update(group)
        trained, _ = group.values(batch)
        assert any(v != 0 for v in flat(trained))  # the head moved off its zero init
        # 1. rank 1 dies: rank 0's weights carry over exactly, the version stays 2, and the group trains on
        t0 = time.monotonic()
        assert "surviving rank 0 (version 2)" in group.restart(kill_and_find(group, [1]))
        print(f"critic restart from a survivor: {time.monotonic() - t0:.1f} s")
        got, version = group.values(batch)
        assert version == group.version == 2
        assert flat(got) == pytest.approx(flat(trained), abs=1e-6)
        update(group)
        assert group.values(batch)[1] == 3
        # 2. a checkpoint at version 3, one more update, then every rank dies: the checkpoint's weights, version 4
        def write(folder):
            for piece in ("state.json", "config.yaml"):
                (folder / piece).write_text("{}")
            (folder / "policy").mkdir()
            (folder / "policy" / "config.json").write_text("{}")
            (folder / "learner").mkdir()
            (folder / "critic").mkdir()
            group.save_state(str(folder / "critic"))

        checkpoint.save(cfg.output_dir, 3, 1, write)
        at_checkpoint, _ = group.values(batch)
        update(group)
        assert "newest checkpoint's critic" in group.restart(kill_and_find(group, [0, 1]))
        got, version = group.values(batch)
        assert version == 4 and flat(got) == pytest.approx(flat(at_checkpoint), abs=1e-6)
        # 3. no checkpoint: the initial weights (a zero head: every value 0); the version still 4
        group.cfg = cfg.model_copy(update={"output_dir": str(tmp_path / "no_checkpoints")})
        assert "initial weights" in group.restart(kill_and_find(group, [0, 1]))
        got, version = group.values(batch)
        assert version == 4 and all(v == 0 for v in flat(got))
        update(group)
        assert group.values(batch)[1] == 5
        # 4. a rank dies during an update: `finish` returns at once (no hang in the broken collective), the lost
        # update still counts in the version, and the restarted group starts from the survivor
        old, _ = group.values(batch)
        started = group.start_train(batch.with_fields(values=old))
        ray.kill(group.ranks[1])
        t0 = time.monotonic()
        assert group.finish(started) == {"critic/update_lost": 1.0} and group.version == 6
        print(f"critic update with a dead rank returned in {time.monotonic() - t0:.1f} s")
        assert group.dead_rank()[0] == 1
        assert "surviving rank 0" in group.restart(1)
        assert group.values(batch)[1] == 6
        update(group)
        assert group.values(batch)[1] == 7
    finally:
        group.shutdown()
