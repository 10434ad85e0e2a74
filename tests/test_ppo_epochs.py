"""Several updates per batch (learner.ppo_epochs x learner.mini_batches_per_step): the seeded mini-batch plan, exact
per-mini-batch normalizers, the metrics of several updates, and real DeepSpeed ranks against a plain-torch
implementation of the same arithmetic (same model, AdamW, loss and mini-batch order) on 1 and 2 ranks."""

import pytest
import torch

from learner.aggregation import count_normalizer
from learner.batch import collate, score_responses
from learner.lr_schedule import schedule_factor, warmup_factor, warmup_schedule
from learner.objective import PolicyLossInputs, compute_policy_loss, finalize_metrics
from learner.update_plan import combine_updates, mini_batch_order
from protocols.config import ConfigError, load_config
from protocols.training_batch import TrainingBatch
from tests.conftest import at_once


def make_batch(num_samples: int, seed: int = 0) -> TrainingBatch:
    # Ragged responses (1 to 6 tokens) and one masked sample, so a normalizer of the wrong mini-batch shows up.
    g = torch.Generator().manual_seed(seed)
    prompts, responses, behavior, advantages = [], [], [], []
    for i in range(num_samples):
        length = 1 + (i * 5) % 6
        prompts.append([1, 3 + i % 10, 13, 3 + (i * 7) % 10, 14])
        responses.append(torch.randint(3, 13, (length,), generator=g).tolist())
        behavior.append((-2.5 + 0.1 * torch.randn(length, generator=g)).tolist())
        advantages.append([1.0 if i % 2 else -1.0] * length)
    return TrainingBatch.from_samples(prompts, responses, behavior, advantages=advantages,
                                      sample_mask=[i != 3 for i in range(num_samples)])


# ------------------------------------------------------------------------------------------------- the plan


def test_each_epoch_is_a_seeded_partition_of_the_batch():
    plan = mini_batch_order(10, ppo_epochs=3, mini_batches=3, seed=(0, 7))
    assert len(plan) == 3
    for epoch in plan:
        # 10 samples in 3 mini-batches: sizes 4, 3, 3, each sample exactly once, sorted inside
        assert sorted(len(p) for p in epoch) == [3, 3, 4]
        assert sorted(i for p in epoch for i in p) == list(range(10))
        assert all(p == sorted(p) for p in epoch)
    assert plan[0] != plan[1]  # a fresh shuffle every epoch
    assert mini_batch_order(10, 3, 3, (0, 7)) == plan  # same seed, same plan
    assert mini_batch_order(10, 3, 3, (0, 8)) != plan  # the next batch gets another one


def test_one_mini_batch_is_the_batch_in_its_own_order():
    assert mini_batch_order(6, ppo_epochs=2, mini_batches=1, seed=(3, 1)) == [[list(range(6))], [list(range(6))]]


def test_warmup_rises_linearly_over_optimizer_steps():
    # 4 warm-up steps: steps 1..4 use 1/4, 2/4, 3/4, 1 of the lr, then 1; 0 steps: always the full lr
    assert [warmup_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_cosine_decay_after_the_warmup():
    # 2 warm-up steps, then 4 decay steps to 0.2: steps 1, 2 use 1/2, 1; step 2 + j uses
    # 0.2 + 0.8 * (1 + cos(pi j / 4)) / 2: j=1 0.2 + 0.4 * 1.70711 = 0.88284, j=2 0.6, j=3 0.2 + 0.4 * 0.29289 =
    # 0.31716, j=4 0.2; then 0.2 for good
    got = [schedule_factor(k, 2, 4, 0.2) for k in range(8)]
    assert got == pytest.approx([0.5, 1.0, 0.88284, 0.6, 0.31716, 0.2, 0.2, 0.2], abs=1e-5)
    # no warm-up, decay over 2 steps to 0: step 1 is at (1 + cos(pi/2)) / 2 = 0.5, step 2 at 0
    assert [schedule_factor(k, 0, 2) for k in range(3)] == pytest.approx([0.5, 0.0, 0.0], abs=1e-12)
    # no decay: the warm-up alone
    assert [schedule_factor(k, 4) for k in range(6)] == [warmup_factor(k, 4) for k in range(6)]


def test_the_schedule_sets_the_optimizer_lr_at_every_step():
    # lr 1e-3, 1 warm-up step, 2 decay steps to 0.5: the optimizer's lr at steps 1, 2, 3, 4 is
    # 1e-3, 1e-3 * (0.5 + 0.5 * 0.5) = 7.5e-4, 5e-4, 5e-4; started after 2 completed steps it is at 5e-4 at once
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule, seen = warmup_schedule(optimizer, 1, decay_steps=2, min_ratio=0.5), []
    for _ in range(4):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == pytest.approx([1e-3, 7.5e-4, 5e-4, 5e-4], rel=1e-9)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    warmup_schedule(optimizer, 1, completed_steps=2, decay_steps=2, min_ratio=0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_mini_batch_normalizer_counts_the_loss_mask_of_its_samples():
    batch = make_batch(8)
    # lengths 1 + (5i mod 6) = 1, 6, 5, 4, 3, 2, 1, 6; sample 3 (4 tokens) masked: 28 - 4 = 24 tokens, 7 sequences
    whole = count_normalizer(batch.loss_mask, 16)
    assert (whole.global_num_tokens, whole.global_num_sequences) == (24.0, 7.0)
    # samples 0, 2, 3, 5: 1 + 5 + (masked) + 2 = 8 tokens in 3 sequences
    part = count_normalizer(batch.select([0, 2, 3, 5]).loss_mask, 16)
    assert (part.global_num_tokens, part.global_num_sequences) == (8.0, 3.0)


def test_combined_metrics_of_four_updates():
    # Two epochs of two updates over a batch of 10 loss tokens (6 + 4). Epoch 0 clips 0 then 2 tokens, epoch 1
    # clips 3 and 1: per-epoch clip fractions 2/10 and 4/10; all updates together 6/20.
    def update(tokens, clipped, loss, seconds):
        return {"num_tokens": tokens, "num_sequences": 2.0, "clip_frac": clipped, "loss": loss,
                "grad_norm_max": seconds, "learner_seconds_max": seconds, "learner/real_tokens": 20.0}

    per_update = [(0, update(6.0, 0.0, 0.4, 1.0)), (0, update(4.0, 2.0, 0.2, 2.0)),
                  (1, update(4.0, 3.0, 0.3, 3.0)), (1, update(6.0, 1.0, 0.1, 4.0))]
    summed = combine_updates(per_update, ppo_epochs=2)
    means = finalize_metrics(summed)
    assert summed["learner/clip_frac_epoch0"] == pytest.approx(0.2)
    assert summed["learner/clip_frac_epoch1"] == pytest.approx(0.4)
    assert means["clip_frac"] == pytest.approx(0.3)
    assert means["num_tokens"] == 10.0 and means["num_sequences"] == 4.0  # the batch's counts, not 2x
    assert means["loss"] == pytest.approx((0.4 + 0.2 + 0.3 + 0.1) / 4)  # mean loss of an update
    assert summed["learner_seconds_max"] == 10.0 and summed["grad_norm_max"] == 4.0  # time adds, norms max
    assert summed["learner/real_tokens"] == 80.0 and summed["learner/optimizer_steps"] == 4.0


def test_one_update_leaves_the_metrics_as_they_were():
    metrics = {"num_tokens": 7.0, "clip_frac": 1.0, "loss": 0.5, "learner_seconds_max": 2.0, "ratio_max": 1.1}
    summed = combine_updates([(0, dict(metrics))], ppo_epochs=1)
    assert {k: summed[k] for k in metrics} == metrics
    assert summed["learner/clip_frac_epoch0"] == pytest.approx(1.0 / 7.0)
    assert summed["learner/optimizer_steps"] == 1.0


def test_config_limits_and_mini_batch_split():
    cfg = load_config(None, ["learner.ppo_epochs=2", "learner.mini_batches_per_step=4"])
    assert (cfg.learner.ppo_epochs, cfg.learner.mini_batches_per_step) == (2, 4)
    with pytest.raises(ConfigError, match="ppo_epochs"):
        load_config(None, ["learner.ppo_epochs=0"])
    # 2 prompts x 4 samples = 8 samples, 2 ranks: 3 mini-batches cannot each hold a multiple of 2 samples
    base = ["learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "learner.num_ranks=2"]
    with pytest.raises(ConfigError, match="mini_batches_per_step=3 does not split the 8 samples"):
        load_config(None, [*base, "learner.mini_batches_per_step=3"])
    # token budgets need no equal split, but every rank needs a sample: 8 // 5 = 1 < 2 ranks
    with pytest.raises(ConfigError, match="Lower mini_batches_per_step to at most 4"):
        load_config(None, [*base, "learner.mini_batches_per_step=5", "learner.max_tokens_per_micro_batch=64"])
    load_config(None, [*base, "learner.mini_batches_per_step=3", "learner.max_tokens_per_micro_batch=64"])


# ---------------------------------------------------------------------------- plain-torch reference updates


def reference_updates(model: torch.nn.Module, samples: dict, cfg, plan: list[list[list[int]]]) -> list[dict]:
    """The learner's arithmetic written out in plain torch on one process: proximal log-probs of the whole batch
    before the first update, then per mini-batch one padded forward pass, compute_policy_loss with the
    mini-batch's normalizer, the global gradient-norm clip and an AdamW step at the warmed-up learning rate.
    Returns each update's metrics (with `lr`, the rate the step used)."""
    lcfg, temperature = cfg.learner, cfg.rollout.temperature
    optimizer = torch.optim.AdamW(model.parameters(), lr=lcfg.lr, betas=lcfg.betas, weight_decay=lcfg.weight_decay)
    schedule = warmup_schedule(optimizer, lcfg.lr_warmup_steps)
    everything = list(range(samples.num_samples))
    with torch.no_grad():
        proximal, _ = score_responses(model, collate(samples, 0), temperature, 0)
    out = []
    for mini_batches in plan:
        for idx in mini_batches:
            part = samples.select(idx)
            batch = collate(part, 0)
            logprobs, entropy = score_responses(model, batch, temperature, 0)
            inputs = PolicyLossInputs(
                behavior_logprobs=part.behavior_logprobs, advantages=part.advantages, loss_mask=part.loss_mask,
                proximal_logprobs=proximal[idx, :part.width], entropy=entropy.detach())
            loss, metrics = compute_policy_loss(logprobs, inputs, cfg.algorithm, count_normalizer(
                part.loss_mask, cfg.rollout.max_response_tokens))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), lcfg.max_grad_norm)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            schedule.step()  # once per optimizer step
            out.append({**finalize_metrics(metrics), "lr": lr})
    assert everything  # the batch is not empty
    return out


class TokenTable(torch.nn.Module):
    """A causal 'LM' whose logits at a position are a learned table row of the current token: enough for the
    scoring and update arithmetic without a transformer."""

    def __init__(self, vocab: int = 15, seed: int = 0) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)))

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        logits = self.table[input_ids]
        return type("Out", (), {"logits": logits[:, -logits_to_keep:] if logits_to_keep else logits})()


def test_clip_is_idle_on_the_first_update_and_active_after_it_in_plain_torch():
    cfg = load_config(None, ["learner.lr=0.3", "learner.ppo_epochs=2", "learner.mini_batches_per_step=2",
                             "rollout.max_response_tokens=16", "algorithm.preset=dapo"])
    samples = make_batch(8)
    plan = mini_batch_order(8, 2, 2, (0, 0))
    metrics = reference_updates(TokenTable(), samples, cfg, plan)
    # the first update's policy is the proximal one: every ratio is 1, nothing clips; an AdamW step of 0.3 on
    # every logit then moves later ratios past DAPO's band [0.8, 1.28]
    assert metrics[0]["clip_frac"] == 0.0 and metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert all(m["clip_frac"] > 0 for m in metrics[1:]), [m["clip_frac"] for m in metrics]


def test_split_mini_batch_gives_the_gradient_of_the_whole_mini_batch():
    # The mini-batch's normalizer is global to it: two micro-batches add up to the one-piece gradient.
    cfg = load_config(None, ["algorithm.preset=dapo"])
    samples, idx = make_batch(8), [0, 2, 5, 6]
    normalizer = count_normalizer(samples.select(idx).loss_mask, 16)

    def grad(parts: list[list[int]]) -> torch.Tensor:
        model = TokenTable()
        for indices in parts:
            part = samples.select(indices)
            logprobs, _ = score_responses(model, collate(part, 0), 1.0, 0)
            inputs = PolicyLossInputs(
                behavior_logprobs=part.behavior_logprobs, advantages=part.advantages, loss_mask=part.loss_mask,
                proximal_logprobs=logprobs.detach())
            compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)[0].backward()
        return model.table.grad

    whole = grad([idx])
    assert whole.abs().sum() > 0
    torch.testing.assert_close(grad([[0, 5], [2, 6]]), whole, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------ real DeepSpeed ranks

EPOCH_OVERRIDES = ["learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "learner.lr=4e-2",
                   "learner.lr_warmup_steps=4",
                   "algorithm.preset=dapo", "rollout.max_response_tokens=16", "learner.logits_chunk_tokens=0",
                   "learner.ppo_epochs=2", "learner.mini_batches_per_step=2"]


def train_on_ranks(model_path: str, overrides: list[str]) -> tuple[dict, list[dict], dict]:
    """(finalized metrics of one batch, each update's metrics, the weights after it) from a real LearnerGroup."""
    import ray

    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, [*EPOCH_OVERRIDES, *overrides])
    samples = make_batch(8)
    group = LearnerGroup(cfg, model_path)
    try:
        summed = group.train_step(samples, count_normalizer(samples.loss_mask, 16))
        packed = ray.get(group.publish_weights().refs[0])
    finally:
        group.shutdown()
    weights = {k: torch.from_numpy(v.copy()) for k, (_, v) in packed.items()}
    return {**finalize_metrics(summed), **summed}, group.last_update_metrics, weights


@pytest.mark.slow
def test_two_epochs_of_two_mini_batches_match_plain_torch_on_one_and_two_ranks(ray_cluster, tiny_models):
    from transformers import AutoModelForCausalLM

    path = tiny_models["untied"]
    cfg = load_config(None, EPOCH_OVERRIDES)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    want_metrics = reference_updates(model.train(), make_batch(8), cfg, mini_batch_order(8, 2, 2, (0, 0)))
    want = {k: v.detach() for k, v in model.state_dict().items()}
    assert want_metrics[0]["clip_frac"] == 0.0
    assert all(m["clip_frac"] > 0 for m in want_metrics[1:]), [m["clip_frac"] for m in want_metrics]

    runs = {
        "1 rank, 4 micro-batches of 1 sample per update": ["learner.micro_batch_size=1"],
        "2 ranks zero2, token budget": ["learner.num_ranks=2", "learner.max_tokens_per_micro_batch=12"],
    }
    trained = {}
    # the two groups run at once
    results = at_once(*[(train_on_ranks, path, overrides) for overrides in runs.values()])
    for name, (metrics, per_update, weights) in zip(runs, results):
        trained[name] = weights
        assert metrics["learner/optimizer_steps"] == 4 and metrics["learner/optimizer_steps_total_max"] == 4, name
        # the warm-up counts optimizer steps: the batch's 4 steps use lr 1/4, 2/4, 3/4 and 4/4 of 4e-2 (a schedule
        # stepped per batch would have stayed at 1/4)
        assert [m["learner/lr_max"] for m in per_update] == pytest.approx([1e-2, 2e-2, 3e-2, 4e-2]), name
        assert [m["lr"] for m in want_metrics] == pytest.approx([1e-2, 2e-2, 3e-2, 4e-2])
        assert metrics["num_tokens"] == 24  # the batch's loss tokens, not counted once per epoch
        # the clip is idle on the first mini-batch (proximal = the weights it starts from) and active after it
        got_clip = [m["clip_frac"] for m in per_update]
        assert got_clip[0] == 0.0 and all(c > 0 for c in got_clip[1:]), (name, got_clip)
        assert got_clip == pytest.approx([m["clip_frac"] for m in want_metrics], abs=1e-6), name
        assert metrics["learner/clip_frac_epoch1"] > 0, name
        for got_m, want_m in zip(per_update, want_metrics):
            assert got_m["loss"] == pytest.approx(want_m["loss"], rel=1e-4, abs=1e-6), name
        # Four AdamW steps of lr 1e-2 to 4e-2. Adam divides by sqrt(v): on a near-zero gradient float noise from
        # another summation order becomes a step of up to lr, so a rare element is off by up to 3e-4 (measured:
        # 2.8e-4 in 1 of 32768, on a loaded machine), while the mean gap stays near 2e-7. A wrong normalizer,
        # proximal, mini-batch order or warm-up count moves every weight by whole steps (1e-2 and more).
        for key, tensor in want.items():
            if key.endswith("k_proj.bias"):
                # softmax ignores a constant shift of the keys: this gradient is float noise whose sign decides
                # Adam's step, so only its size is checked (a step of at most lr per update)
                assert (weights[key] - tensor).abs().max() <= 2 * (1e-2 + 2e-2 + 3e-2 + 4e-2), (name, key)
                continue
            assert_same_steps(weights[key], tensor, f"{name} {key}")
    # the same batch over 1 and 2 ranks (and other micro-batches) gives the same weights after the 4 updates
    one, two = trained.values()
    for key, tensor in one.items():
        if not key.endswith("k_proj.bias"):
            assert_same_steps(two[key], tensor, key)


def assert_same_steps(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Weights after the same 4 AdamW steps: every element within 8e-4 (2% of the largest step, 4e-2) and the
    mean gap under 4e-6 (a wrong update moves the mean by about 1e-2)."""
    gap = (got - want).abs()
    assert gap.max() <= 8e-4, (name, float(gap.max()))
    assert gap.mean() <= 4e-6, (name, float(gap.mean()))
