"""Sequence parallelism: packing and slicing rows (pure functions), and two gloo ranks sharing one row whose loss,
log-probs and summed gradients equal a single process scoring each sample whole."""

import os
import socket

import pytest
import torch

from learner.sequence_parallel import (
    pack_row,
    per_sample_to_columns,
    response_values,
    sequence_parallel_layout,
    sequence_parallel_logprobs,
    shard_row,
)
from learner.ulysses_attention import check_heads_split, packed_causal_mask
from protocols.config import ConfigError, load_config
from protocols.training_batch import TrainingBatch

# --- groups and config ------------------------------------------------------------------------------------------


def test_layout_puts_consecutive_ranks_in_one_sp_group():
    # world 4 = dp 2 x sp 2: rows of the grid are SP groups, columns are DP groups
    sp_groups, dp_groups = sequence_parallel_layout(4, 2)
    assert sp_groups == [[0, 1], [2, 3]]
    assert dp_groups == [[0, 2], [1, 3]]
    assert sequence_parallel_layout(2, 1) == ([[0], [1]], [[0, 1]])


def test_layout_refuses_a_size_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match="sequence_parallel_size=3 does not divide the 4 learner ranks"):
        sequence_parallel_layout(4, 3)


def test_config_refuses_sequence_parallel_size_not_dividing_num_ranks():
    with pytest.raises(ConfigError, match="sequence_parallel_size=2 does not divide learner.num_ranks=3"):
        load_config(None, ["learner.num_ranks=3", "learner.sequence_parallel_size=2"])
    cfg = load_config(None, ["learner.num_ranks=4", "learner.sequence_parallel_size=2"])
    assert cfg.learner.sequence_parallel_size == 2
    assert load_config(None, []).learner.sequence_parallel_size == 1


def test_config_splits_the_batch_over_data_parallel_groups_not_ranks():
    # 4 ranks = 2 groups x sp 2: 2 prompts x 3 samples = 6 samples split over 2 groups (not 4 ranks)
    cfg = load_config(None, ["learner.num_ranks=4", "learner.sequence_parallel_size=2",
                             "learner.prompts_per_step=2", "rollout.samples_per_prompt=3"])
    assert cfg.samples_per_step == 6
    with pytest.raises(ConfigError, match="do not split evenly over learner.num_ranks=4"):
        load_config(None, ["learner.num_ranks=4", "learner.prompts_per_step=3", "rollout.samples_per_prompt=2"])
    # 3 x 3 = 9 samples over 2 groups: refused with sample-count micro-batches, fine with a token budget
    odd = ["learner.num_ranks=4", "learner.sequence_parallel_size=2", "learner.prompts_per_step=3",
           "rollout.samples_per_prompt=3"]
    with pytest.raises(ConfigError, match="= 2 data-parallel groups"):
        load_config(None, odd)
    assert load_config(None, [*odd, "learner.max_tokens_per_micro_batch=64"]).samples_per_step == 9


def test_config_refuses_zero3_with_sequence_parallelism():
    sp = ["learner.num_ranks=2", "learner.sequence_parallel_size=2"]
    with pytest.raises(ConfigError, match="zero_stage=3 with learner.sequence_parallel_size=2"):
        load_config(None, [*sp, "learner.zero_stage=3"])
    # whole-sequence quantities are reduced over the SP group, so GSPO and sequence masks are allowed
    assert load_config(None, [*sp, "algorithm.preset=gspo"]).algorithm.policy_loss.type == "gspo"


def test_heads_must_split_over_the_sp_ranks():
    check_heads_split(num_heads=2, num_kv_heads=1, sp_size=2)  # one KV head, copied to both ranks
    check_heads_split(num_heads=8, num_kv_heads=4, sp_size=2)
    with pytest.raises(ValueError, match="does not divide the model's 3 attention heads"):
        check_heads_split(num_heads=3, num_kv_heads=1, sp_size=2)
    with pytest.raises(ValueError, match="3 KV heads"):
        check_heads_split(num_heads=6, num_kv_heads=3, sp_size=2)


# --- rows and slices --------------------------------------------------------------------------------------------


def _one_sample_row():
    # prompt [5, 6], response [7, 8, 9], pad 0, padded to a multiple of 2: 5 tokens -> 6 columns
    return pack_row(TrainingBatch.from_samples([[5, 6]], [[7, 8, 9]], advantages=[[0.5, 0.25, -1.0]]), pad_id=0,
                    per_token=("advantages",), multiple_of=2)


def test_pack_row_puts_each_response_token_at_the_column_predicting_it():
    row = _one_sample_row()
    assert row.input_ids.tolist() == [[5, 6, 7, 8, 9, 0]]
    # padding continues the positions: one causal sequence, no mask needed
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 5]]
    # column 1 (token 6) predicts 7, column 2 predicts 8, column 3 predicts 9; the prompt's own next tokens and the
    # last token are not scored
    assert row.target_ids.tolist() == [[0, 7, 8, 9, 0, 0]]
    assert row.loss_mask.tolist() == [[False, True, True, True, False, False]]
    assert row.per_token["advantages"].tolist() == [[0.0, 0.5, 0.25, -1.0, 0.0, 0.0]]
    assert row.sample_index.tolist() == [[0, 0, 0, 0, 0, -1]]
    assert row.response_columns == [[1, 2, 3]]


def test_shard_boundary_last_column_predicts_first_token_of_next_slice():
    row = _one_sample_row()
    first, second = shard_row(row, 0, 2), shard_row(row, 1, 2)
    assert first.input_ids.tolist() == [[5, 6, 7]]
    assert second.input_ids.tolist() == [[8, 9, 0]]
    # the last column of slice 0 holds 7 and predicts 8, which is the first token of slice 1
    assert first.target_ids.tolist() == [[0, 7, 8]]
    assert second.target_ids.tolist() == [[9, 0, 0]]
    assert first.loss_mask.tolist() == [[False, True, True]]
    assert second.loss_mask.tolist() == [[True, False, False]]
    assert first.per_token["advantages"].tolist() == [[0.0, 0.5, 0.25]]
    assert second.per_token["advantages"].tolist() == [[-1.0, 0.0, 0.0]]
    assert second.position_ids.tolist() == [[3, 4, 5]]
    assert (first.start, second.start) == (0, 3)


def test_packed_row_restarts_positions_and_never_predicts_across_samples():
    # sample 0: prompt [1], response [2, 3]; sample 1: prompt [4, 5], response [6]; 6 tokens padded to 8
    row = pack_row(TrainingBatch.from_samples([[1], [4, 5]], [[2, 3], [6]]), pad_id=0, multiple_of=4)
    assert row.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 0, 0]]
    assert row.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    # column 2 (token 3, sample 0's last) must not predict token 4 of sample 1
    assert row.target_ids.tolist() == [[2, 3, 0, 0, 6, 0, 0, 0]]
    assert row.loss_mask.tolist() == [[True, True, False, False, True, False, False, False]]
    assert row.sample_index.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1]]
    assert row.response_columns == [[0, 1], [4]]


def test_slices_concatenate_back_to_the_row():
    row = pack_row(TrainingBatch.from_samples([[1, 2, 3], [4]], [[5, 6, 7, 8], [9, 10]],
                                              advantages=[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0]]),
                   pad_id=0, per_token=("advantages",), multiple_of=6)
    for sp_size in (1, 2, 3, 6):
        shards = [shard_row(row, r, sp_size) for r in range(sp_size)]
        for name in ("input_ids", "position_ids", "target_ids", "loss_mask", "sample_index"):
            assert torch.equal(torch.cat([getattr(s, name) for s in shards], dim=1), getattr(row, name))
        assert torch.equal(torch.cat([s.per_token["advantages"] for s in shards], dim=1), row.per_token["advantages"])
        # every response token is scored exactly once over the slices: 4 + 2 = 6
        assert sum(int(s.loss_mask.sum()) for s in shards) == 6


def test_shard_row_refuses_a_row_that_does_not_split():
    row = pack_row(TrainingBatch.from_samples([[1, 2]], [[3]]), pad_id=0)  # 3 columns
    with pytest.raises(ValueError, match="3 columns does not split over learner.sequence_parallel_size=2"):
        shard_row(row, 0, 2)


def test_response_values_reads_per_sample_values_back():
    row = pack_row(TrainingBatch.from_samples([[1], [4, 5]], [[2, 3], [6]]), pad_id=0, multiple_of=4)
    values = torch.arange(8, dtype=torch.float32)[None] * 10  # column c holds 10 c
    assert response_values(values, row, 2).tolist() == [[0.0, 10.0], [40.0, 0.0]]


def test_per_sample_values_reach_every_column_of_the_sample_in_any_slice():
    row = pack_row(TrainingBatch.from_samples([[1], [4, 5]], [[2, 3], [6]]), pad_id=0, multiple_of=4)  # sample_index [0, 0, 0, 1, 1, 1, -1, -1]
    sample_mask = torch.tensor([False, True])
    columns = per_sample_to_columns(shard_row(row, 1, 2), sample_mask)  # slice 1: columns 4-7
    assert columns.tolist() == [[True, True, False, False]]
    # 1 / |y_i| for seq_mean_token_mean: |y_0| = 2, |y_1| = 1
    inverse_lengths = per_sample_to_columns(row, torch.tensor([0.5, 1.0]))
    assert inverse_lengths.tolist() == [[0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 0.0, 0.0]]


def test_pack_row_refuses_per_token_values_of_the_wrong_length():
    with pytest.raises(ValueError, match="`advantages` of sample 0 has 1 values for 2 response tokens"):
        TrainingBatch.from_samples([[1]], [[2, 3]], advantages=[[1.0]])


def test_packed_causal_mask_is_block_diagonal_causal():
    # positions [0, 1, 0, 1, 2]: segments [0, 0, 1, 1, 1]
    mask = packed_causal_mask(torch.tensor([[0, 1, 0, 1, 2]]))
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)
    assert packed_causal_mask(torch.arange(5)[None]) is None  # one sequence: sdpa's is_causal does it


# --- two gloo ranks ---------------------------------------------------------------------------------------------

PAD = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases() -> dict[str, tuple[list[list[int]], list[list[int]], list[list[float]]]]:
    """Prompts, responses and per-token advantages; the same on every rank (fixed generator)."""
    gen = torch.Generator().manual_seed(7)

    def sample(prompt_len: int, response_len: int):
        prompt = torch.randint(3, 15, (prompt_len,), generator=gen).tolist()
        response = torch.randint(3, 15, (response_len,), generator=gen).tolist()
        return prompt, response, torch.randn(response_len, generator=gen).tolist()

    def case(*lengths):
        prompts, responses, advantages = zip(*(sample(p, r) for p, r in lengths))
        return list(prompts), list(responses), list(advantages)

    return {
        # 6 + 21 = 27 tokens -> 28 columns, slices of 14: the boundary falls inside the response
        "one_sample": case((6, 21)),
        # 12 + 9 + 8 = 29 -> 30 columns, slices of 15: the boundary falls inside sample 1 (columns 12-20)
        "packed": case((3, 9), (4, 5), (2, 6)),
    }


def _reference(model, prompts, responses, advantages, num_tokens):
    """Each sample alone through the plain model: loss = sum_t logprob_t * advantage_t / num_tokens."""
    model.zero_grad()
    total, logprobs = 0.0, []
    for prompt, response, adv in zip(prompts, responses, advantages):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids, position_ids=torch.arange(ids.size(1))[None]).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        loss = (lp * torch.tensor(adv)).sum() / num_tokens
        loss.backward()
        total += float(loss.detach())
        logprobs.append(lp.detach().tolist())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return total, logprobs, grads


def _sp_loss(model, shard, num_tokens):
    logprobs = sequence_parallel_logprobs(model, shard)
    per_token = torch.where(shard.loss_mask, logprobs * shard.per_token["advantages"], torch.zeros(()))
    return per_token.sum() / num_tokens, logprobs


def _compare(loss, logprobs, grads, reference) -> dict[str, float]:
    ref_loss, ref_logprobs, ref_grads = reference
    flat = [a - b for row, ref_row in zip(logprobs or [], ref_logprobs) for a, b in zip(row, ref_row)]
    return {
        "loss_diff": abs(loss - ref_loss),
        "logprob_diff": max((abs(d) for d in flat), default=0.0),
        "grad_diff": max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads),
        "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
        "num_params": len(grads),
        "num_ref_params": len(ref_grads),
    }


def _torch_path_worker(rank: int, port: int, folders: dict[str, str], out_path: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from learner.sequence_parallel import build_sequence_parallel_groups, gather_sequence
    from learner.ulysses_attention import install_ulysses_attention

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    groups = build_sequence_parallel_groups(2)
    results = {}
    runs = [("kv1", "one_sample", False), ("kv1", "packed", False), ("kv2", "packed", False),
            ("kv1", "packed", True)]
    cases = _cases()
    for model_name, case_name, checkpointing in runs:
        prompts, responses, advantages = cases[case_name]
        num_tokens = sum(len(r) for r in responses)
        load = dict(attn_implementation="sdpa", dtype=torch.float32)
        baseline = AutoModelForCausalLM.from_pretrained(folders[model_name], **load)
        model = AutoModelForCausalLM.from_pretrained(folders[model_name], **load)
        install_ulysses_attention(model, groups.sp_group, ALL_ATTENTION_FUNCTIONS)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        batch = TrainingBatch.from_samples(prompts, responses, advantages=advantages)
        row = pack_row(batch, PAD, ("advantages",), multiple_of=groups.sp_size)
        shard = shard_row(row, groups.sp_rank, groups.sp_size)
        loss, logprobs = _sp_loss(model, shard, num_tokens)
        loss.backward()
        # The SP all-reduce: each rank holds its part of the row's gradient; their sum is the whole.
        for p in model.parameters():
            dist.all_reduce(p.grad, group=groups.sp_group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=groups.sp_group)
        row_logprobs = batch.per_sample_rows(
            response_values(gather_sequence(logprobs.detach(), groups.sp_group), row, batch.width))
        grads = {n: p.grad for n, p in model.named_parameters()}
        reference = _reference(baseline, prompts, responses, advantages, num_tokens)
        key = f"{model_name}/{case_name}" + ("/checkpointing" if checkpointing else "")
        results[key] = _compare(float(total), row_logprobs, grads, reference)
        # Scoring without gradients (reference / proximal log-probs) takes the same path.
        with torch.no_grad():
            model.eval()
            scored = sequence_parallel_logprobs(model, shard)
        scored_rows = batch.per_sample_rows(response_values(gather_sequence(scored, groups.sp_group), row, batch.width))
        results[key]["no_grad_logprob_diff"] = max(
            abs(a - b) for r, s in zip(scored_rows, reference[1]) for a, b in zip(r, s))
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def sp_models(tmp_path_factory) -> dict[str, str]:
    """The demo shape (hidden 128, 2 layers, 2 heads of 64): one KV head (copied to both SP ranks) and two."""
    from demos.arithmetic_model import build_random_model

    root = tmp_path_factory.mktemp("sp_models")
    return {"kv1": build_random_model(root / "kv1", tied=True, kv_heads=1, seed=3),
            "kv2": build_random_model(root / "kv2", tied=False, kv_heads=2, seed=4)}


def _assert_equal_to_reference(results: dict, tolerance: float = 1e-5) -> None:
    for key, r in results.items():
        assert r["num_params"] == r["num_ref_params"], key
        assert r["grad_scale"] > 1e-3, f"{key}: gradients too small to compare ({r['grad_scale']})"
        for metric in ("loss_diff", "logprob_diff", "grad_diff"):
            assert r[metric] <= tolerance, f"{key}: {metric}={r[metric]:.3g} over {tolerance}"
        if "no_grad_logprob_diff" in r:
            assert r["no_grad_logprob_diff"] <= tolerance, key


@pytest.mark.slow
def test_two_sp_ranks_match_one_process_loss_logprobs_and_gradients(sp_models, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "results.pt"
    mp.spawn(_torch_path_worker, args=(_free_port(), sp_models, str(out)), nprocs=2, join=True)
    results = torch.load(out)
    assert set(results) == {"kv1/one_sample", "kv1/packed", "kv2/packed", "kv1/packed/checkpointing"}
    _assert_equal_to_reference(results)


# --- through a DeepSpeed engine (ZeRO-2, the SP mpu) ----------------------------------------------------------------


def _deepspeed_worker(rank: int, world_size: int, port: int, folder: str, out_path: str) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM

    from learner.rank_setup import init_distributed
    from learner.sequence_parallel_rank import deepspeed_loss_scale, enable_sequence_parallel

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"})
    init_distributed(deepspeed, "gloo", rank, world_size, f"tcp://127.0.0.1:{port}")
    load = dict(attn_implementation="sdpa", dtype=torch.float32)
    baseline = AutoModelForCausalLM.from_pretrained(folder, **load)
    model = AutoModelForCausalLM.from_pretrained(folder, **load)
    groups, mpu = enable_sequence_parallel(model, sp_size=2)
    lr = 0.1
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), mpu=mpu,
        config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
                "steps_per_print": 10**9})
    # Each DP group trains on its own samples; the loss is normalized by the tokens of all of them.
    cases = _cases()
    per_dp = [cases["one_sample"], cases["packed"]][: groups.dp_size]
    num_tokens = sum(len(r) for _, responses, _ in per_dp for r in responses)
    prompts, responses, advantages = per_dp[groups.dp_rank]
    row = pack_row(TrainingBatch.from_samples(prompts, responses, advantages=advantages), PAD, ("advantages",),
                       multiple_of=groups.sp_size)
    shard = shard_row(row, groups.sp_rank, groups.sp_size)
    loss, _ = _sp_loss(engine.module, shard, num_tokens)
    engine.backward(loss * deepspeed_loss_scale(groups))
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    before = {n: p.detach().clone() for n, p in baseline.named_parameters()}
    engine.step()
    after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    total = loss.detach().clone()
    dist.all_reduce(total)
    all_samples = [sum((list(c[i]) for c in per_dp), []) for i in range(3)]
    reference = _reference(baseline, *all_samples, num_tokens)
    # Log-probs are checked in the torch-path test; here the loss, the gradients and the step.
    result = _compare(float(total), None, grads, reference)
    # SGD after clipping to norm 1 (DeepSpeed: scale by 1 / (norm + 1e-6) when the norm is over 1), with the norm
    # and the gradient of the whole batch: a per-rank norm or gradient would move the weights differently.
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in reference[2].values())))
    scale = min(1.0, 1.0 / (norm + 1e-6))
    result["grad_norm"] = norm
    result["step_diff"] = max(float((after[n] - (before[n] - lr * scale * reference[2][n])).abs().max())
                              for n in before)
    result["ds_ulysses_diff"] = _versus_deepspeed_ulysses(groups)
    if rank == 0:
        torch.save(result, out_path)
    dist.barrier()


def _versus_deepspeed_ulysses(groups) -> float:
    """Largest gap between our Ulysses attention and DeepSpeed's UlyssesSPAttentionHF (ALST) on the same slices
    of random q, k, v: 4 heads, 1 KV head (copied to both ranks by both), 6 positions per rank."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from learner.ulysses_attention import UlyssesAttention

    heads, kv_heads, head_dim, local = 4, 1, 64, 6
    gen = torch.Generator().manual_seed(11)
    full = [torch.randn(1, h, local * groups.sp_size, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads)]
    query, key, value = (t[:, :, groups.sp_rank * local: (groups.sp_rank + 1) * local] for t in full)
    positions = torch.arange(groups.sp_rank * local, (groups.sp_rank + 1) * local)[None]

    def layer():
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = heads // kv_heads, True
        return module

    ours, _ = UlyssesAttention(groups.sp_group, "sdpa", heads, kv_heads)(
        sdpa_attention_forward, layer(), query, key, value, None, position_ids=positions)
    deepspeed_attention = UlyssesSPAttentionHF(
        attn=sdpa_attention_forward, batch_size=1, attn_head_count=heads, attn_head_size=head_dim,
        kv_head_count=kv_heads, num_hidden_layers=1, process_group=groups.sp_group, seq_length_is_variable=True)
    theirs, _ = deepspeed_attention(layer(), query, key, value, None, position_ids=positions)
    return float((ours.reshape(theirs.shape) - theirs).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_deepspeed_zero2_engine_sums_sp_gradients_and_averages_dp(sp_models, tmp_path, monkeypatch, world_size):
    """sp 2 over 2 ranks (dp 1) and over 4 ranks (dp 2, each DP group with its own samples): DeepSpeed reduces over
    all ranks of the SP mpu and divides by dp, so with the loss share scaled by dp the step applies the gradient of
    the whole batch, clipped by its norm."""
    import torch.multiprocessing as mp

    from cluster.rank_group import RANK_ENV

    for name, value in RANK_ENV.items():  # the workers start as the learner's ranks do (no TorchInductor)
        monkeypatch.setenv(name, value)
    out = tmp_path / "result.pt"
    mp.spawn(_deepspeed_worker, args=(world_size, _free_port(), sp_models["kv1"], str(out)), nprocs=world_size,
             join=True)
    result = torch.load(out)
    _assert_equal_to_reference({"deepspeed": result})
    assert result["step_diff"] <= 1e-6
    # DeepSpeed's own Ulysses attention runs on gloo too, and gives the same numbers as ours.
    assert result["ds_ulysses_diff"] <= 1e-6
