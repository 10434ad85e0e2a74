"""The typed training batch: built once, its loss_mask read by every consumer (collate, packing, sequence
parallelism, normalizers, losses), split by one plan. Pure torch."""

import pytest
import torch

from learner.aggregation import count_normalizer
from learner.batch import collate, collate_packed, score_responses
from learner.batch_plan import MicroBatching, plan_batch
from learner.objective import PolicyLossInputs, compute_policy_loss
from learner.sequence_parallel import pack_row
from protocols.config import load_config
from protocols.training_batch import TrainingBatch
from protocols.trajectory import Prompt, Trajectory
from tests.test_ppo_epochs import TokenTable


def tool_batch() -> TrainingBatch:
    # sample 0: 2 sampled tokens, 2 tool-output tokens (context only), 1 sampled token; sample 1: 3 sampled tokens
    return TrainingBatch.from_samples(
        [[1, 2], [1, 3, 4]], [[5, 6, 7, 8, 9], [10, 11, 12]],
        [[-1.0, -2.0, 0.0, 0.0, -3.0], [-1.5, -2.5, -3.5]],
        model_token_mask=[[True, True, False, False, True], [True, True, True]],
        advantages=[[1.0] * 5, [-1.0] * 3])


def test_loss_mask_is_sampled_tokens_of_kept_samples():
    batch = tool_batch()
    assert batch.loss_mask.tolist() == [[True, True, False, False, True], [True, True, True, False, False]]
    assert batch.token_mask.tolist() == [[True] * 5, [True, True, True, False, False]]
    dropped = batch.with_sample_mask(torch.tensor([True, False]))
    assert dropped.loss_mask[1].sum() == 0 and dropped.sample_mask.tolist() == [True, False]
    # 3 + 3 loss tokens in 2 sequences; dropping sample 1 leaves 3 in 1
    assert (count_normalizer(batch.loss_mask, 8).global_num_tokens, count_normalizer(dropped.loss_mask, 8)
            .global_num_sequences) == (6.0, 1.0)


def test_select_trims_to_the_longest_selected_response_and_masked_trains_nothing():
    batch = tool_batch()
    part = batch.select([1])
    assert part.width == 3 and part.response(0) == [10, 11, 12] and part.prompt_ids == [[1, 3, 4]]
    assert part.advantages.tolist() == [[-1.0, -1.0, -1.0]]
    assert batch.masked().loss_mask.sum() == 0 and batch.masked().response_ids.equal(batch.response_ids)


def test_per_token_values_of_the_wrong_length_are_refused():
    with pytest.raises(ValueError, match="`advantages` of sample 0 has 1 values for 2 response tokens"):
        TrainingBatch.from_samples([[1]], [[2, 3]], advantages=[[1.0]])
    with pytest.raises(ValueError, match=r"TrainingBatch.values has shape \(1, 3\), expected \(1, 2\)"):
        TrainingBatch.from_samples([[1]], [[2, 3]]).with_fields(values=torch.zeros(1, 3))


def test_from_trajectories_keeps_every_field_and_round_trips_through_disk(tmp_path):
    trajectories = [Trajectory(group_id="g", sample_index=i, prompt=Prompt(prompt_id="p", prompt_token_ids=[1, 2]),
                               response_token_ids=[3 + i] * (i + 1), behavior_logprobs=[-0.5] * (i + 1),
                               token_versions=[i] * (i + 1), finish_reason="length" if i else "stop",
                               reward=float(i), ref_logprobs=[-1.0] * (i + 1)) for i in range(2)]
    batch = TrainingBatch.from_trajectories(trajectories)
    assert batch.response_ids.tolist() == [[3, 0], [4, 4]]
    # the versions stay on the trajectories (the queue's staleness reads their min and max): no rank reads them
    assert not hasattr(batch, "token_versions")
    assert batch.truncated.tolist() == [False, True] and batch.rewards.tolist() == [0.0, 1.0]
    assert batch.ref_logprobs.tolist() == [[-1.0, 0.0], [-1.0, -1.0]] and batch.values is None
    batch.save(tmp_path / "batch.pt")
    loaded = TrainingBatch.load(tmp_path / "batch.pt")
    assert loaded.prompt_ids == batch.prompt_ids and loaded.loss_mask.equal(batch.loss_mask)
    assert loaded.ref_logprobs.equal(batch.ref_logprobs)


def test_collate_puts_tool_tokens_in_the_input_and_the_loss_mask_in_the_packed_row():
    batch = tool_batch()
    padded, packed = collate(batch, pad_id=0), collate_packed(batch, pad_id=0)
    # padded: prompts right-aligned at column 3, then the whole response, tool tokens included
    assert padded.input_ids[0].tolist() == [0, 1, 2, 5, 6, 7, 8, 9] and padded.input_ids[1].tolist()[:6] == [
        1, 3, 4, 10, 11, 12]
    assert packed.input_ids.tolist() == [[1, 2, 5, 6, 7, 8, 9, 1, 3, 4, 10, 11, 12]]
    model = TokenTable()
    for layout in (padded, packed):
        # every response token is scored (a micro-batch with nothing to train still runs through the model);
        # which of them train is the loss's business
        logprobs, _ = score_responses(model, layout, 1.0, 0)
        assert (logprobs[~batch.token_mask] == 0).all() and (logprobs[batch.token_mask] < 0).all()
    # packing: sample 0's tool tokens sit at row columns 4 and 5 (predicted by 3 and 4): no loss there
    row = pack_row(batch, pad_id=0, per_token=("advantages",))
    assert row.loss_mask[0].nonzero().squeeze(1).tolist() == [1, 2, 5, 9, 10, 11]


def _grad(batch: TrainingBatch, parts: list[list[int]], preset: str) -> tuple[torch.Tensor, float]:
    cfg = load_config(None, [f"algorithm.preset={preset}"])
    model = TokenTable()
    normalizer = count_normalizer(batch.loss_mask, 8)
    total = 0.0
    for idx in parts:
        part = batch.select(idx)
        logprobs, entropy = score_responses(model, collate(part, 0), 1.0, 0)
        inputs = PolicyLossInputs(behavior_logprobs=part.behavior_logprobs, advantages=part.advantages,
                                  loss_mask=part.loss_mask, proximal_logprobs=logprobs.detach() - 0.1,
                                  ref_logprobs=part.ref_logprobs, entropy=entropy)
        loss, _ = compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)
        loss.backward()
        total += float(loss.detach())
    return model.table.grad, total


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo", "cispo"])
def test_values_at_tool_positions_change_nothing(preset):
    # the contract of tool-using rollouts: tool tokens are context only, so nothing the batch holds at their
    # positions (or at padding) reaches the loss or the gradient
    batch = tool_batch()
    batch = batch.with_fields(ref_logprobs=torch.where(batch.token_mask, -1.2, 0.0))
    grad, loss = _grad(batch, [[0, 1]], preset)
    assert grad.abs().sum() > 0
    # 1e4 in every field at every position off the loss mask (tool tokens and padding)
    off = ~batch.loss_mask
    poisoned = batch.with_fields(**{name: torch.where(off, 1e4, getattr(batch, name))
                                    for name in ("behavior_logprobs", "advantages", "ref_logprobs")})
    grad2, loss2 = _grad(poisoned, [[0, 1]], preset)
    torch.testing.assert_close(grad2, grad)
    assert loss2 == pytest.approx(loss)


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo"])
def test_one_or_two_micro_batches_give_the_same_gradient(preset):
    batch = tool_batch()
    batch = batch.with_fields(ref_logprobs=torch.where(batch.token_mask, -1.2, 0.0))
    whole, _ = _grad(batch, [[0, 1]], preset)
    split, _ = _grad(batch, [[0], [1]], preset)
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)


def test_plan_splits_every_sample_once_with_equal_micro_batch_counts():
    cfg = load_config(None, ["learner.max_tokens_per_micro_batch=12", "learner.packing=true"])
    lengths = [1, 9, 3, 7, 2, 8, 4, 6]
    batch = TrainingBatch.from_samples([[1, 2]] * 8, [[5] * n for n in lengths])
    plan = plan_batch(batch, MicroBatching.of_policy(cfg), num_groups=2)
    assert sorted(i for shard in plan.shards for i in shard) == list(range(8))
    assert len({len(m) for m in plan.micro_batches}) == 1  # every rank runs as many micro-batches
    for shard, micro in zip(plan.shards, plan.micro_batches):
        assert sorted(i for mb in micro for i in mb) == list(range(len(shard)))
        tokens = [batch.sample_tokens()[shard[i]] for mb in micro for i in mb]
        assert all(t <= 12 for t in tokens)


def test_a_padding_micro_batch_trains_nothing_but_still_reaches_the_parameters():
    # ZeRO reduces gradients inside backward: a rank whose micro-batch has nothing to train must still run a
    # backward through the model, or the ranks' collectives stop lining up
    batch = tool_batch()
    empty = batch.masked()
    model = TokenTable()
    logprobs, _ = score_responses(model, collate(empty, 0), 1.0, 0)
    inputs = PolicyLossInputs(behavior_logprobs=empty.behavior_logprobs, advantages=empty.advantages,
                              loss_mask=empty.loss_mask, proximal_logprobs=logprobs.detach())
    loss, _ = compute_policy_loss(logprobs, inputs, load_config(None, []).algorithm,
                                  count_normalizer(batch.loss_mask, 8))
    loss.backward()
    assert float(loss) == 0.0 and model.table.grad is not None and float(model.table.grad.abs().sum()) == 0.0
