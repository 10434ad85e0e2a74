"""learner/prepare.py: the driver's batch preparation as a pure function of the batch and the config."""

import pytest
import torch

from learner.prepare import learner_scores_ref, prepare_batch, staleness_metrics
from protocols.config import load_config
from protocols.training_batch import TrainingBatch


def _batch(rewards: list[float], **fields) -> TrainingBatch:
    # two samples per prompt, responses of 2 tokens, behavior log-prob -1 on each
    n = len(rewards)
    return TrainingBatch.from_samples([[1]] * n, [[5, 6]] * n, [[-1.0, -1.0]] * n, rewards=rewards, **fields)


def test_dr_grpo_batch_gets_group_mean_advantages_on_every_loss_token():
    # dr_grpo: advantage = reward - group mean, broadcast to the tokens. Group [1, 0]: mean 0.5 -> [0.5, -0.5];
    # group [1, 1]: mean 1 -> [0, 0]
    cfg = load_config(None, ["algorithm.preset=dr_grpo", "rollout.samples_per_prompt=2"])
    prepared = prepare_batch(_batch([1.0, 0.0, 1.0, 1.0]), cfg)
    torch.testing.assert_close(prepared.batch.advantages,
                               torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]))
    # the normalizer counts every loss token (8) and sequence (4) of the global batch
    assert prepared.normalizer.global_num_tokens == 8.0 and prepared.normalizer.global_num_sequences == 4.0
    assert prepared.batch.returns is None and prepared.batch.ref_logprobs is None


def test_masked_truncated_sample_leaves_the_loss_but_keeps_its_group_baseline():
    # dapo masks truncated samples: sample 1 (reward 0, truncated) leaves the loss mask, the normalizer counts 3
    # samples and 6 tokens, and the group baseline still counts it (sample 0's advantage is not 0)
    cfg = load_config(None, ["algorithm.preset=dapo", "rollout.samples_per_prompt=2",
                             "algorithm.overlong.enabled=false", "algorithm.mask_truncated=true"])
    prepared = prepare_batch(_batch([1.0, 0.0, 1.0, 0.0], truncated=[False, True, False, False]), cfg)
    assert prepared.batch.loss_mask.sum(dim=1).tolist() == [2, 0, 2, 2]
    assert prepared.normalizer.global_num_tokens == 6.0 and prepared.normalizer.global_num_sequences == 3.0
    assert float(prepared.batch.advantages[0, 0]) > 0 and float(prepared.batch.advantages[1].abs().sum()) == 0.0


def test_kl_in_the_reward_lowers_the_reward_by_beta_times_the_summed_kl():
    # reinforce with k1 in the reward, beta 0.5: k1 per token = mu - ref = -1 - (-1.5) = 0.5, summed over 2 tokens
    # = 1.0, so the shaped scalar is R - 0.5 * 1.0: [1 - 0.5, 0 - 0.5] = [0.5, -0.5]; reinforce uses it as is
    cfg = load_config(None, ["algorithm.preset=reinforce", "rollout.samples_per_prompt=2", "algorithm.kl.beta=0.5",
                             "algorithm.kl.placement=reward", "algorithm.kl.estimator=k1"])
    prepared = prepare_batch(_batch([1.0, 0.0], ref_logprobs=[[-1.5, -1.5]] * 2), cfg)
    torch.testing.assert_close(prepared.batch.advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))


def test_kl_in_the_reward_without_ref_logprobs_is_refused():
    cfg = load_config(None, ["algorithm.preset=rloo", "rollout.samples_per_prompt=2"])
    with pytest.raises(ValueError, match="algorithm.kl.placement=reward needs the batch's ref_logprobs"):
        prepare_batch(_batch([1.0, 0.0]), cfg)


def test_learner_scores_ref_only_when_the_ranks_hold_it_and_it_is_read_outside_one_update():
    assert learner_scores_ref(load_config(None, ["algorithm.preset=rloo"]))  # KL in the reward
    assert not learner_scores_ref(load_config(None, ["algorithm.preset=rloo", "reference.num_workers=1"]))
    assert not learner_scores_ref(load_config(None, ["algorithm.preset=dapo"]))  # no KL
    # grpo's KL is in the loss: the ranks score the reference inside the update, unless the batch trains twice
    assert not learner_scores_ref(load_config(None, ["algorithm.preset=grpo"]))
    assert learner_scores_ref(load_config(None, ["algorithm.preset=grpo", "learner.ppo_epochs=2"]))


def test_staleness_reads_each_samples_oldest_sampled_token():
    # at version 5: sample 0 sampled at [3, 4] -> lag 2, mixed; sample 1 at [5] then a tool token (-1) -> lag 0
    from protocols.trajectory import ToolCall
    from tests.test_replay_queue import make_group

    mixed, tooled = make_group("g", [1.0, 0.0], 5).trajectories
    mixed = mixed.model_copy(update={"response_token_ids": [5, 6], "behavior_logprobs": [-1.0, -1.0],
                                     "token_versions": [3, 4]})
    tooled = tooled.model_copy(update={"response_token_ids": [7, 8], "behavior_logprobs": [-1.0, 0.0],
                                       "token_versions": [5, -1],
                                       "tool_calls": [ToolCall(name="calculator", arguments="1+1", output="2",
                                                               output_start=1, output_tokens=1)]})
    assert (mixed.min_version, mixed.max_version, tooled.min_version) == (3, 4, 5)
    out = staleness_metrics([mixed, tooled], 5)
    assert out == {"staleness/mean": 1.0, "staleness/max": 2.0, "staleness/hist_0": 0.5, "staleness/hist_2": 0.5,
                   "staleness/mixed_version_frac": 0.5}


def test_the_driver_refuses_a_batch_too_stale_or_with_a_group_of_another_size_before_the_learner_sees_it():
    from cluster.trainer import Trainer
    from tests.test_replay_queue import make_group

    trainer = Trainer.__new__(Trainer)  # the step's checks alone: no actor, no learner
    trainer.cfg = load_config(None, ["rollout.samples_per_prompt=2", "train.max_staleness=1"])
    trainer.version, trainer.trained_group_ids, trainer.training_pools = 3, [], []
    # version 1 is 2 behind the learner's 3, one more than max_staleness=1
    with pytest.raises(RuntimeError, match="2 versions old, more than train.max_staleness=1"):
        trainer.step([make_group("fresh", [1.0, 0.0], 3), make_group("old", [1.0, 0.0], 1)])
    # a group of 3 beside one of 2 would put a sample of one group in the other's baseline
    with pytest.raises(ValueError, match=r"groups of \[3, 2\] samples in a row, not rollout.samples_per_prompt=2"):
        trainer.step([make_group("g3", [1.0, 0.0, 1.0], 3), make_group("g2", [1.0, 0.0], 3)])


def test_the_batch_numbers_its_groups_and_prepare_refuses_rows_that_are_not_whole_groups_in_a_row():
    from tests.test_replay_queue import make_group

    cfg = load_config(None, ["rollout.samples_per_prompt=2", "algorithm.preset=grpo"])
    a, b = make_group("a", [1.0, 0.0], 0).trajectories, make_group("b", [1.0, 1.0], 0).trajectories
    batch = TrainingBatch.from_trajectories([*a, *b])
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    assert batch.select([3, 2]).group_index.tolist() == [1, 1]
    # whole groups in a row: group a [1, 0] has mean 0.5 and sample std sqrt(0.5), so advantages +-0.5/0.7071 =
    # +-0.7071; group b [1, 1] has no signal, 0
    advantages = prepare_batch(batch, cfg).batch.advantages
    assert advantages[:, 0].tolist() == pytest.approx([0.7071, -0.7071, 0.0, 0.0], abs=1e-3)
    # a group split over rows 0 and 2: positions would pair a's first sample with b's
    interleaved = TrainingBatch.from_trajectories([a[0], b[0], a[1], b[1]])
    assert interleaved.group_index.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match=r"groups of \[1, 1, 1, 1\] samples in a row \(a group split over "
                                         r"non-adjacent rows\), not rollout.samples_per_prompt=2"):
        prepare_batch(interleaved, cfg)
    # a batch built by hand without group ids is taken by position, as before
    assert TrainingBatch.from_samples([[1]] * 2, [[5], [6]]).group_index is None
