"""learner/distillation.py and its place in prepare_batch: the teacher's per-token advantage, the mix with the
verifier's advantage, its metrics, and the settings that are refused."""

import math

import pytest
import torch

from learner.distillation import distillation_metrics, mix_advantages, reverse_kl_per_token, teacher_advantages
from learner.policy_losses import ppo_clip_loss
from learner.prepare import check_streamed_scores, prepare_batch
from protocols.config import ConfigError, load_config
from protocols.training_batch import TrainingBatch
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup

TEACHER = ["teacher.path=/models/teacher", "teacher.num_workers=1"]


def test_teacher_advantage_is_teacher_minus_behavior_logprob_on_sampled_tokens_only():
    # mu = [-1, -2, -0.5], teacher = [-0.5, -3, -0.5], mask [1, 1, 0]:
    # A = -(mu - teacher) = [-(-1 + 0.5), -(-2 + 3), 0] = [0.5, -1.0, 0] (the third token carries no loss)
    mu = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5]])
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(teacher_advantages(mu, teacher, mask), torch.tensor([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(reverse_kl_per_token(mu, teacher, mask), torch.tensor([[-0.5, 1.0, 0.0]]))


def test_mix_weights_the_two_sources():
    # weight 0.25: 0.25 * teacher + 0.75 * reward; [0.25*2 + 0.75*(-1), 0.25*0 + 0.75*1] = [-0.25, 0.75]
    reward_adv, teacher_adv = torch.tensor([[-1.0, 1.0]]), torch.tensor([[2.0, 0.0]])
    torch.testing.assert_close(mix_advantages(reward_adv, teacher_adv, 0.25), torch.tensor([[-0.25, 0.75]]))
    assert mix_advantages(reward_adv, teacher_adv, 0.0) is reward_adv
    assert mix_advantages(reward_adv, teacher_adv, 1.0) is teacher_adv
    with pytest.raises(ValueError, match=r"algorithm.distillation.weight=1.5 must lie in \[0, 1\]"):
        mix_advantages(reward_adv, teacher_adv, 1.5)


def test_on_policy_distillation_loss_is_minus_mean_advantage_at_ratio_one():
    # At the sampling policy (logprobs = behavior), the importance ratio is 1 and the PPO-clip surrogate is
    # -ratio * A = -A per token; token-mean over the 2 sampled tokens of A = [0.5, -1.0] gives -(0.5 - 1.0) / 2 = 0.25.
    # Its gradient pushes up log pi on the token the teacher likes more (A > 0) and down on the other.
    mu = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-0.5, -3.0, -0.5]])
    mask = torch.tensor([[True, True, False]])
    logprobs = mu.clone().requires_grad_(True)
    adv = teacher_advantages(mu, teacher, mask)
    per_token, _ = ppo_clip_loss(logprobs, mu, adv, mask, eps_low=0.2, eps_high=0.28)
    loss = per_token[mask].mean()
    assert math.isclose(float(loss.detach()), 0.25, abs_tol=1e-6)
    loss.backward()
    assert float(logprobs.grad[0, 0]) < 0 < float(logprobs.grad[0, 1]) and float(logprobs.grad[0, 2]) == 0.0


def test_metrics_give_the_reverse_kl_its_position_quarters_and_the_teachers_share():
    # one sample, 4 sampled tokens, mu - teacher = [1, 2, 3, 4]: mean 2.5, quarters [1, 2, 3, 4]; weight 0.5 with
    # reward advantages of magnitude 1 on each token: teacher part 0.5 * (1+2+3+4) = 5, reward part 0.5 * 4 = 2,
    # share 5 / 7
    mu = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    teacher = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    m = distillation_metrics(mu, teacher, mask, torch.ones(1, 4), 0.5)
    assert m["teacher/reverse_kl_mean"] == 2.5
    assert [m[f"teacher/reverse_kl_q{i}"] for i in range(1, 5)] == [1.0, 2.0, 3.0, 4.0]
    assert math.isclose(m["teacher/advantage_share"], 5 / 7)
    assert math.isclose(m["teacher/reverse_kl_p50"], 2.5)


def _batch(rewards: list[float], teacher: list[list[float]] | None) -> TrainingBatch:
    n = len(rewards)
    return TrainingBatch.from_samples([[1]] * n, [[5, 6]] * n, [[-1.0, -1.0]] * n, rewards=rewards,
                                      teacher_logprobs=teacher)


def test_prepare_mixes_the_teacher_into_the_group_advantages_and_drops_the_teacher_logprobs():
    # dr_grpo, group [1, 0]: reward advantages [0.5, -0.5] per token. Teacher log-probs [-0.5, -2] on both samples
    # against mu = -1: teacher advantages [0.5, -1]. Weight 0.5: sample 0 -> [0.5*0.5 + 0.5*0.5, 0.5*-1 + 0.5*0.5]
    # = [0.5, -0.25]; sample 1 -> [0.25 - 0.25, -0.5 - 0.25] = [0, -0.75]
    cfg = load_config(None, ["algorithm.preset=dr_grpo", "rollout.samples_per_prompt=2",
                             "algorithm.distillation.weight=0.5", *TEACHER])
    prepared = prepare_batch(_batch([1.0, 0.0], [[-0.5, -2.0]] * 2), cfg)
    torch.testing.assert_close(prepared.batch.advantages, torch.tensor([[0.5, -0.25], [0.0, -0.75]]))
    assert prepared.batch.teacher_logprobs is None  # the ranks read the advantages only
    assert prepared.metrics["teacher/reverse_kl_mean"] == 0.25  # mean of mu - teacher = [-0.5, 1] over 4 tokens


def test_pure_distillation_trains_a_group_whose_rewards_are_all_equal():
    # group [0, 0]: no signal from the reward, but weight 1 keeps the teacher's [0.5, -1] on every sampled token
    cfg = load_config(None, ["algorithm.preset=grpo", "algorithm.kl.beta=0", "rollout.samples_per_prompt=2",
                             "algorithm.distillation.weight=1", *TEACHER])
    prepared = prepare_batch(_batch([0.0, 0.0], [[-0.5, -2.0]] * 2), cfg)
    torch.testing.assert_close(prepared.batch.advantages, torch.tensor([[0.5, -1.0], [0.5, -1.0]]))
    assert prepared.metrics["teacher/advantage_share"] == 1.0


def test_pure_distillation_takes_groups_of_one_sample_each_from_its_own_prompt():
    # G = 1: rewards [1, 0] are two groups of one (grpo gives each exactly 0); weight 1 trains on the teacher's
    # advantages alone: sample 0 [-0.5 - -1, -2 - -1] = [0.5, -1], sample 1 [-3 - -1, -1 - -1] = [-2, 0]
    cfg = load_config(None, ["algorithm.preset=grpo", "algorithm.kl.beta=0", "rollout.samples_per_prompt=1",
                             "learner.prompts_per_step=2", "algorithm.distillation.weight=1", *TEACHER])
    prepared = prepare_batch(_batch([1.0, 0.0], [[-0.5, -2.0], [-3.0, -1.0]]), cfg)
    torch.testing.assert_close(prepared.batch.advantages, torch.tensor([[0.5, -1.0], [-2.0, 0.0]]))
    assert prepared.metrics["teacher/advantage_share"] == 1.0


def test_groups_of_one_sample_are_refused_where_the_reward_trains():
    for overrides in (["algorithm.distillation.weight=0.5", *TEACHER], []):
        with pytest.raises(ConfigError, match=r"rollout.samples_per_prompt=1 with algorithm.distillation.weight="
                                              r".*Set rollout.samples_per_prompt=2 or more"):
            load_config(None, ["algorithm.preset=grpo", "rollout.samples_per_prompt=1", *overrides])
    with pytest.raises(ConfigError, match=r"advantage type 'rloo'"):
        load_config(None, ["algorithm.preset=rloo", "rollout.samples_per_prompt=1",
                           "algorithm.distillation.weight=1", *TEACHER])


def test_weight_zero_measures_the_teacher_and_trains_on_the_reward():
    cfg = load_config(None, ["algorithm.preset=dr_grpo", "rollout.samples_per_prompt=2", *TEACHER])
    prepared = prepare_batch(_batch([1.0, 0.0], [[-0.5, -2.0]] * 2), cfg)
    torch.testing.assert_close(prepared.batch.advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))
    assert prepared.metrics["teacher/advantage_share"] == 0.0 and "teacher/reverse_kl_mean" in prepared.metrics


def test_a_batch_without_teacher_logprobs_is_refused_when_teachers_run():
    cfg = load_config(None, TEACHER)
    with pytest.raises(RuntimeError, match=r"teacher.num_workers=1 but the batch reached the learner without"):
        check_streamed_scores(_batch([1.0, 0.0], None), cfg, ["g7", "g7"])


def test_distillation_settings_that_cannot_run_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"algorithm.distillation.weight=0.5 trains on a teacher's log-probs, but "
                                          r"teacher.num_workers=0"):
        load_config(None, ["algorithm.distillation.weight=0.5"])
    with pytest.raises(ConfigError, match=r"teacher.num_workers=1 but teacher.path is empty"):
        load_config(None, ["teacher.num_workers=1"])
    with pytest.raises(ConfigError, match=r"but teacher.num_workers=0, so no worker would score with it"):
        load_config(None, ["teacher.path=/models/teacher"])
    with pytest.raises(ConfigError, match=r"algorithm.dynamic_sampling=false"):
        load_config(None, ["algorithm.preset=dapo", "algorithm.distillation.weight=1", *TEACHER])


def test_a_group_takes_teacher_logprobs_of_matching_shape_and_the_batch_collates_them():
    def traj(i: int, n: int) -> Trajectory:
        return Trajectory(group_id="g", sample_index=i, prompt=Prompt(prompt_id="p", prompt_token_ids=[1]),
                          response_token_ids=[2] * n, behavior_logprobs=[-1.0] * n, token_versions=[0] * n,
                          finish_reason="stop")

    group = TrajectoryGroup(group_id="g", trajectories=[traj(0, 2), traj(1, 1)])
    scored = group.with_token_scores("teacher", [[-0.5, -0.25], [-2.0]])
    assert [t.teacher_logprobs for t in scored.trajectories] == [[-0.5, -0.25], [-2.0]]
    assert all(t.ref_logprobs is None for t in scored.trajectories)
    batch = TrainingBatch.from_trajectories(scored.trajectories)
    torch.testing.assert_close(batch.teacher_logprobs, torch.tensor([[-0.5, -0.25], [-2.0, 0.0]]))
    with pytest.raises(ValueError, match="teacher log-probs of shape"):
        group.with_token_scores("teacher", [[-0.5], [-2.0]])


def test_teacher_with_another_vocabulary_is_refused_before_any_actor(tiny_models, tmp_path):
    import json
    import shutil

    from cluster.pools import TeacherPool

    policy = tiny_models["untied"]
    TeacherPool.precheck(load_config(None, ["teacher.num_workers=1", f"teacher.path={tiny_models['tied']}"]), policy)
    swapped = tmp_path / "teacher"
    shutil.copytree(policy, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    cfg = load_config(None, ["teacher.num_workers=1", f"teacher.path={swapped}"])
    with pytest.raises(ValueError, match=r"teacher.path=.* does not share the policy's vocabulary.*different ids"):
        TeacherPool.precheck(cfg, policy)
