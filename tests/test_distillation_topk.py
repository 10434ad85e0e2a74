"""Top-k on-policy distillation (algorithm.distillation.top_k): the forward KL from the teacher's renormalized
top-k to the student, its gradient, the chunked head that scores k ids a position, the teacher's top-k, the
records that carry them, prepare_batch and the policy loss, and the settings that are refused."""

import math
import pickle

import pytest
import torch

from learner.aggregation import count_normalizer
from learner.batch import collate, collate_packed, response_logits, score_responses, score_responses_at
from learner.batch import score_responses_topk
from learner.distillation import topk_forward_kl, topk_mass
from learner.logprobs import chunked_logprobs_entropy, chunked_topk_logprobs
from learner.objective import PolicyLossInputs, compute_policy_loss
from learner.prepare import check_streamed_scores, prepare_batch
from protocols.config import ConfigError, load_config
from protocols.training_batch import TrainingBatch
from protocols.trajectory import Prompt, TokenScores, Trajectory, TrajectoryGroup
from tests.test_logprobs import PROMPTS, RESPONSES, tiny_model

TEACHER = ["teacher.path=/models/teacher", "teacher.num_workers=1"]
LOG = math.log


def test_topk_forward_kl_by_hand_on_a_three_token_vocabulary():
    # student logits z = [0, 0, 0]: pi = [1/3, 1/3, 1/3]. Teacher top-2: ids [0, 1] with p = [0.6, 0.3] (mass 0.9),
    # renormalized to [2/3, 1/3]. KL = 2/3 (log 2/3 - log 1/3) + 1/3 (log 1/3 - log 1/3) = 2/3 log 2 = 0.4621
    z = torch.zeros(1, 1, 3, requires_grad=True)
    ids = torch.tensor([[[0, 1]]])
    student_at = torch.log_softmax(z, dim=-1).gather(-1, ids)
    teacher = torch.tensor([[[LOG(0.6), LOG(0.3)]]])
    kl = topk_forward_kl(student_at, teacher, torch.tensor([[True]]))
    assert math.isclose(float(kl.detach()), 2 / 3 * LOG(2), rel_tol=1e-6)
    assert math.isclose(topk_mass(teacher, torch.tensor([[True]])), 0.9, rel_tol=1e-6)
    # d KL / dz = pi - p_T (p_T = 0 off the top 2) = [1/3 - 2/3, 1/3 - 1/3, 1/3 - 0] = [-1/3, 0, 1/3]: descent raises
    # the logit the teacher prefers, leaves the one both agree on, lowers the one outside the teacher's top-k
    kl.sum().backward()
    torch.testing.assert_close(z.grad[0, 0], torch.tensor([-1 / 3, 0.0, 1 / 3]))


def test_topk_forward_kl_is_zero_at_the_teacher_and_masked_off_the_loss_tokens():
    # student = teacher's renormalized top-2 exactly ([2/3, 1/3], nothing outside): KL 0; second token masked: 0
    student_at = torch.tensor([[[LOG(2 / 3), LOG(1 / 3)], [-5.0, -6.0]]])
    teacher = torch.tensor([[[LOG(0.6), LOG(0.3)], [LOG(0.5), LOG(0.5)]]])
    kl = topk_forward_kl(student_at, teacher, torch.tensor([[True, False]]))
    torch.testing.assert_close(kl, torch.zeros(1, 2), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_head_scores_several_ids_a_position_with_the_full_logits_gradient(chunk):
    g = torch.Generator().manual_seed(0)
    n, h, v, temperature = 7, 8, 11, 0.7
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (0.4 * torch.randn(v, h, generator=g)).requires_grad_()
    targets = torch.randint(0, v, (n, 3), generator=g)
    targets[0, 2] = targets[0, 1]  # a repeated id: its two gradients add
    w = torch.randn(n, 3, generator=g)
    lp, ent = chunked_logprobs_entropy(hidden, weight, targets, temperature=temperature, chunk_tokens=chunk)
    grads = torch.autograd.grad((lp * w).sum() + ent.sum(), [hidden, weight])
    full = torch.log_softmax((hidden @ weight.t()) / temperature, dim=-1)
    lp_ref = full.gather(-1, targets)
    ent_ref = -(full.exp() * full).sum(-1)
    grads_ref = torch.autograd.grad((lp_ref * w).sum() + ent_ref.sum(), [hidden, weight])
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    ids, top = chunked_topk_logprobs(hidden.detach(), weight.detach(), 4, temperature=temperature, chunk_tokens=chunk)
    ref = full.detach().topk(4, dim=-1)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(top, ref.values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("chunk", [0, 3])
def test_model_scores_the_teachers_ids_and_its_own_top_k_as_the_full_logits(packed, chunk):
    model = tiny_model(tied=True)
    padded = collate(TrainingBatch.from_samples(PROMPTS, RESPONSES), pad_id=0)
    with torch.no_grad():
        full = torch.log_softmax(response_logits(model, padded, temperature=0.8), dim=-1)  # (B, T, V)
    batch = (collate_packed if packed else collate)(TrainingBatch.from_samples(PROMPTS, RESPONSES), pad_id=0)
    mask = padded.score_mask
    top = full.topk(4, dim=-1)
    lp_k, ids, top_lp = score_responses_topk(model, batch, 0.8, chunk, 4)
    assert torch.equal(ids, torch.where(mask[..., None], top.indices, 0))
    torch.testing.assert_close(top_lp, torch.where(mask[..., None], top.values, 0.0), rtol=0, atol=1e-5)
    lp_ref, _ = score_responses(model, batch, 0.8, chunk)
    torch.testing.assert_close(lp_k, lp_ref, rtol=0, atol=1e-5)
    # the student's log-probs at the teacher's ids, with grad, in the forward that scores the sampled tokens
    lp, _, at = score_responses_at(model, batch, 0.8, chunk, ids)
    torch.testing.assert_close(lp.detach(), lp_ref.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(at.detach(), top_lp, rtol=0, atol=1e-5)
    assert at.requires_grad
    assert model.get_output_embeddings().forward.__func__ is type(model.get_output_embeddings()).forward


def _traj(i: int, n: int) -> Trajectory:
    return Trajectory(group_id="g", sample_index=i, prompt=Prompt(prompt_id="p", prompt_token_ids=[1]),
                      response_token_ids=[2] * n, behavior_logprobs=[-1.0] * n, token_versions=[0] * n,
                      finish_reason="stop")


def test_a_group_takes_the_teachers_top_k_and_the_batch_collates_it_to_b_t_k():
    group = TrajectoryGroup(group_id="g", trajectories=[_traj(0, 2), _traj(1, 1)])
    assert b"teacher_topk" not in pickle.dumps(group.trajectories[0])  # records without it keep their bytes
    scores = TokenScores(logprobs=[[-0.5, -0.25], [-2.0]], topk_ids=[[[2, 3], [2, 4]], [[5, 2]]],
                         topk_logprobs=[[[-0.1, -3.0], [-0.2, -2.0]], [[-0.3, -2.0]]])
    scored = group.with_token_scores("teacher", scores)
    assert scored.trajectories[1].teacher_topk_ids == [[5, 2]]
    back = pickle.loads(pickle.dumps(scored.trajectories[0]))
    assert back == scored.trajectories[0] == Trajectory.model_validate_json(back.model_dump_json())
    batch = TrainingBatch.from_trajectories(scored.trajectories)
    assert batch.teacher_topk_ids.shape == (2, 2, 2) and batch.teacher_topk_ids.dtype == torch.long
    assert batch.teacher_topk_ids[1].tolist() == [[5, 2], [0, 0]]  # zero past the response's end
    torch.testing.assert_close(batch.teacher_topk_logprobs[0, 1], torch.tensor([-0.2, -2.0]))
    assert batch.select([1]).teacher_topk_logprobs.shape == (1, 1, 2)
    with pytest.raises(ValueError, match="top-k ids for"):
        group.with_token_scores("teacher", TokenScores(scores.logprobs, [[[2, 3]], [[5, 2]]], scores.topk_logprobs))


def _batch(rewards: list[float]) -> TrainingBatch:
    # two response tokens a sample, mu = -1; teacher top-2 at each position: p = [0.5, 0.25] (mass 0.75)
    n = len(rewards)
    return TrainingBatch.from_samples([[1]] * n, [[5, 6]] * n, [[-1.0, -1.0]] * n, rewards=rewards,
                                      teacher_logprobs=[[-0.5, -2.0]] * n,
                                      teacher_topk_ids=[[[5, 7], [6, 7]]] * n,
                                      teacher_topk_logprobs=[[[LOG(0.5), LOG(0.25)]] * 2] * n)


def test_prepare_keeps_the_rewards_share_of_the_advantage_and_sends_the_top_k_to_the_ranks():
    # dr_grpo, group [1, 0]: reward advantages [0.5, -0.5] per token; weight 0.25 with top-k: the advantage is the
    # reward's share only, 0.75 * [0.5, -0.5] = [0.375, -0.375]; the teacher's share is the ranks' top-k loss
    cfg = load_config(None, ["algorithm.preset=dr_grpo", "rollout.samples_per_prompt=2",
                             "algorithm.distillation.weight=0.25", "algorithm.distillation.top_k=2", *TEACHER])
    prepared = prepare_batch(_batch([1.0, 0.0]), cfg)
    torch.testing.assert_close(prepared.batch.advantages, torch.tensor([[0.375, 0.375], [-0.375, -0.375]]))
    assert prepared.batch.teacher_logprobs is None and prepared.batch.teacher_topk_ids is not None
    assert math.isclose(prepared.metrics["teacher/topk_mass"], 0.75, rel_tol=1e-6)
    assert "teacher/advantage_share" not in prepared.metrics and "teacher/reverse_kl_mean" in prepared.metrics
    no_topk = _batch([1.0, 0.0]).with_fields(teacher_topk_ids=None, teacher_topk_logprobs=None)
    with pytest.raises(RuntimeError, match=r"algorithm.distillation.top_k=2 but the batch reached the learner"):
        check_streamed_scores(no_topk, cfg, ["g1", "g1"])


def test_policy_loss_adds_the_weighted_top_k_kl_aggregated_like_the_policy_loss():
    # pure distillation (weight 1): advantages 0, so the PPO term is 0 and the loss is the token mean of the KL.
    # Student pi = [1/3, 1/3, 1/3] at both tokens; teacher top-2 [0.5, 0.25] -> [2/3, 1/3]: KL = 2/3 log 2 per token,
    # the second sample's tokens masked: loss = 2/3 log 2 over the 2 loss tokens, teacher/topk_kl the same sum
    cfg = load_config(None, ["algorithm.preset=dapo", "algorithm.dynamic_sampling=false",
                             "algorithm.distillation.weight=1", "algorithm.distillation.top_k=2", *TEACHER]).algorithm
    mask = torch.tensor([[True, True], [False, False]])
    z = torch.zeros(2, 2, 3, requires_grad=True)
    full = torch.log_softmax(z, dim=-1)
    ids = torch.tensor([[0, 1]]).expand(2, 2, 2)
    lp = full[..., 2]
    teacher = torch.tensor([LOG(0.5), LOG(0.25)]).expand(2, 2, 2)
    inputs = PolicyLossInputs(behavior_logprobs=lp.detach(), advantages=torch.zeros(2, 2), loss_mask=mask,
                              proximal_logprobs=lp.detach(), teacher_topk_logprobs=teacher,
                              topk_logprobs=full.gather(-1, ids))
    loss, metrics = compute_policy_loss(lp, inputs, cfg, count_normalizer(mask, 2))
    assert math.isclose(float(loss.detach()), 2 / 3 * LOG(2), rel_tol=1e-5)
    assert math.isclose(metrics["teacher/topk_kl"], 2 * 2 / 3 * LOG(2), rel_tol=1e-5)
    loss.backward()
    # token mean over 2 tokens: each loss token's logits get (pi - p_T) / 2 = [-1/6, 0, 1/6]; masked ones nothing
    torch.testing.assert_close(z.grad[0, 0], torch.tensor([-1 / 6, 0.0, 1 / 6]))
    torch.testing.assert_close(z.grad[1], torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"algorithm.distillation.top_k=2 needs PolicyLossInputs"):
        without = PolicyLossInputs(behavior_logprobs=lp.detach(), advantages=torch.zeros(2, 2), loss_mask=mask,
                                   proximal_logprobs=lp.detach())
        compute_policy_loss(lp.detach(), without, cfg, count_normalizer(mask, 2))


def test_top_k_settings_that_cannot_run_are_refused_with_the_fix():
    assert load_config(None, []).algorithm.distillation.top_k == 0
    with pytest.raises(ConfigError, match=r"algorithm.distillation.top_k=8 ships the teacher's top-8 tokens for a "
                                          r"loss weighted by algorithm.distillation.weight=0"):
        load_config(None, ["algorithm.distillation.top_k=8", *TEACHER])
    with pytest.raises(ConfigError, match=r"learner.sequence_parallel_size=2"):
        load_config(None, ["algorithm.distillation.top_k=8", "algorithm.distillation.weight=0.5",
                           "learner.sequence_parallel_size=2", *TEACHER])


def test_a_top_k_above_the_teachers_vocabulary_is_refused_before_any_actor(tiny_models):
    from cluster.pools import TeacherPool

    policy = tiny_models["untied"]
    cfg = load_config(None, ["teacher.num_workers=1", f"teacher.path={tiny_models['tied']}",
                             "algorithm.distillation.weight=0.5", "algorithm.distillation.top_k=1024"])
    with pytest.raises(ValueError, match=r"algorithm.distillation.top_k=1024 exceeds the teacher's vocabulary of"):
        TeacherPool.precheck(cfg, policy)


def test_the_teacher_worker_ships_its_top_k_beside_the_sampled_tokens_log_probs(tiny_models):
    # the worker class in this process (its Ray actor runs the same code): a group of 2 responses, k = 4
    from actors.reference_worker import ReferenceWorker
    from actors.teacher_worker import TeacherWorker

    teacher = tiny_models["tied"]
    cfg = load_config(None, ["teacher.num_workers=1", f"teacher.path={teacher}", "algorithm.distillation.weight=1",
                             "algorithm.preset=grpo", "algorithm.distillation.top_k=4"])
    group = TrajectoryGroup(group_id="g", trajectories=[_traj(0, 3), _traj(1, 1)])
    scores = TeacherWorker(cfg, 0, teacher).score_group(group)
    assert isinstance(scores, TokenScores)
    assert [len(r) for r in scores.topk_ids] == [3, 1] and all(len(p) == 4 for r in scores.topk_ids for p in r)
    # the sampled tokens' log-probs are the reference worker's code on the same folder
    plain = ReferenceWorker(cfg, 0, teacher).score_group(group)
    for got, want in zip(scores.logprobs, plain):
        assert got == pytest.approx(want, abs=1e-5)
    for row in scores.topk_logprobs:  # most likely first, probabilities summing to at most 1
        for position in row:
            assert position == sorted(position, reverse=True) and sum(math.exp(x) for x in position) <= 1 + 1e-5
    batch = TrainingBatch.from_trajectories(group.with_token_scores("teacher", scores).trajectories)
    assert batch.teacher_topk_ids.shape == (2, 3, 4)


@pytest.mark.parametrize("chunk", [0, 3])
def test_a_micro_batch_without_response_tokens_scores_to_empty_tensors(chunk):
    # an empty response (an aborted sample) leaves no position to score: (1, 1) and (1, 1, k) zeros, no error
    model = tiny_model(tied=False)
    batch = collate(TrainingBatch.from_samples([[1, 2]], [[]]), pad_id=0)
    lp, _, at = score_responses_at(model, batch, 1.0, chunk, torch.zeros(1, 1, 2, dtype=torch.long))
    assert lp.shape == (1, 1) and at.shape == (1, 1, 2) and float(at.detach().abs().sum()) == 0.0
    _, ids, top = score_responses_topk(model, batch, 1.0, chunk, 2)
    assert ids.shape == (1, 1, 2) and top.shape == (1, 1, 2)
