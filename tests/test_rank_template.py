"""The rank template both trained models run on (learner/rank_template.py), without Ray or DeepSpeed: one optimizer
step over the driver's micro-batches, the non-finite skip, the warm-up and the checkpoint, on a stand-in engine that
does what the template asks of DeepSpeed's; and the one plan and merge the policy's and the critic's groups share."""

import random
from types import SimpleNamespace

import pytest
import torch

from learner.batch_plan import BatchPlan, MicroBatching, merge_rows, plan_batch
from learner.critic_rank import CriticRank
from learner.rank_template import TrainingRank, run_micro_batches
from protocols.config import load_config
from protocols.training_batch import TrainingBatch


class StandInEngine:
    """The calls the template makes on a DeepSpeed engine, over a real torch optimizer and schedule: backward adds
    the gradient, step() at the boundary steps the optimizer and then the schedule, as DeepSpeed does."""

    def __init__(self, model=None, optimizer=None, lr_scheduler=None, config=None, mpu=None) -> None:
        self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
        self._config = SimpleNamespace(train_batch_size=0, gradient_accumulation_steps=0)
        self.boundary = False
        self.calls: list[tuple] = []
        self.saved: dict = {}

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def train(self) -> None:
        pass

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        self.boundary = boundary

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        self.calls.append(("backward", float(loss.detach()), self.boundary))
        loss.backward()

    def step(self) -> None:
        if self.boundary:
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()

    def get_global_grad_norm(self) -> float:
        return 1.5

    def save_checkpoint(self, folder: str, tag: str, save_latest: bool, client_state: dict,
                        exclude_frozen_parameters: bool = False) -> None:
        self.saved[(folder, tag)] = dict(client_state)

    def load_checkpoint(self, folder: str, tag: str, **_) -> tuple:
        if (folder, tag) not in self.saved:
            return None, {}
        return f"{folder}/{tag}", dict(self.saved[(folder, tag)])


def stand_in_deepspeed() -> SimpleNamespace:
    """A `deepspeed` module whose initialize builds a StandInEngine."""
    return SimpleNamespace(initialize=lambda **kw: (StandInEngine(**kw), kw["optimizer"], None, kw["lr_scheduler"]))


def one_weight() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(1))


# ----------------------------------------------------------------------------------------- one optimizer step


def test_one_step_sets_the_boundary_at_the_last_micro_batch_and_scales_each_share_by_the_groups():
    # 2 data-parallel groups, 3 micro-batches (the last a padding one): shares 0.25, 0.5 and 0 of the global loss
    weight = one_weight()
    engine = StandInEngine(optimizer=torch.optim.SGD([weight], lr=0.1))
    shares = {(0, 1): 0.25, (2,): 0.5, (): 0.0}

    def forward_and_loss(idx):
        loss = shares[tuple(idx)] * weight.sum()
        return loss, weight, {"value_loss": float(loss.detach()), "num_tokens": float(len(idx))}

    summed, lr, nonfinite = run_micro_batches(engine, [[0, 1], [2], []], forward_and_loss, 2, torch.device("cpu"),
                                              {})
    # each backward gets its share x 2 (DeepSpeed averages over the 2 groups): 0.5, 1.0, 0.0; one boundary, at the end
    assert engine.calls == [("backward", 0.5, False), ("backward", 1.0, False), ("backward", 0.0, True)]
    # DeepSpeed's bookkeeping: 3 micro-batches per group, 3 x 2 in all
    assert (engine._config.gradient_accumulation_steps, engine._config.train_batch_size) == (3, 6)
    assert summed == {"value_loss": 0.75, "num_tokens": 3.0} and lr == 0.1 and not nonfinite
    # the summed gradient 0.5 + 1.0 + 0 moved the weight once: 1 - 0.1 x 1.5
    assert weight.item() == pytest.approx(0.85)


def test_a_nonfinite_loss_poisons_the_last_backward_so_the_optimizer_skips_the_step():
    # micro-batch 0's loss is NaN; micro-batch 1 is finite but the last: its backward is made NaN too
    weight = one_weight()
    engine = StandInEngine(optimizer=torch.optim.SGD([weight], lr=0.1))
    losses = iter([torch.tensor(float("nan")) * weight.sum(), 0.5 * weight.sum()])
    _, _, nonfinite = run_micro_batches(engine, [[0], [1]], lambda idx: (next(losses), weight, {}), 1,
                                        torch.device("cpu"), {})
    assert nonfinite
    assert [call[1] != call[1] for call in engine.calls] == [True, True]  # NaN != NaN


# ------------------------------------------------------------------------------------------- the warm-up


def critic_rank(*overrides: str) -> CriticRank:
    cfg = load_config(None, ["algorithm.preset=ppo", "critic.num_workers=1", *overrides])
    return CriticRank(cfg, rank=0, world_size=1, model_path="")


def start(rank: TrainingRank, completed_steps: int = 0) -> None:
    """What CriticRank.setup does after loading the model: AdamW at critic.lr, the engine through the template."""
    c = rank.cfg.critic
    optimizer = torch.optim.AdamW([one_weight()], lr=c.lr, weight_decay=c.weight_decay)
    rank._start_engine(stand_in_deepspeed(), None, optimizer, {}, c.warmup_steps, completed_steps)


def lr_of_next_update(rank: TrainingRank) -> float:
    weight = rank.optimizer.param_groups[0]["params"][0]
    _, readings = rank._optimizer_step([[0]], lambda idx: (weight.sum(), weight, {}))
    return readings.lr


def test_the_critic_warms_up_through_the_policys_schedule():
    # critic.lr 3e-3 over 4 warm-up updates: update u uses 3e-3 x min(1, (u + 1) / 4), the policy's rule.
    # Update 0: 3e-3 / 4 = 7.5e-4; update 1: 3e-3 x 2/4 = 1.5e-3; update 4 (= warmup_steps): the full 3e-3.
    rank = critic_rank("critic.lr=3e-3", "critic.warmup_steps=4")
    start(rank)
    used = [lr_of_next_update(rank) for _ in range(5)]
    assert used == pytest.approx([7.5e-4, 1.5e-3, 2.25e-3, 3e-3, 3e-3], rel=1e-12)


def test_a_restarted_critic_continues_its_warm_up_from_its_version():
    # a group restarted at version 1 (from a survivor) uses update 1's rate next: 1.5e-3; set back to version 3
    # (after a checkpoint load, the updates lost since counted), update 3's: 3e-3 x 4/4
    rank = critic_rank("critic.lr=3e-3", "critic.warmup_steps=4")
    start(rank, completed_steps=1)
    assert lr_of_next_update(rank) == pytest.approx(1.5e-3, rel=1e-12)
    rank.set_version(3)
    assert lr_of_next_update(rank) == pytest.approx(3e-3, rel=1e-12)


def test_no_warm_up_is_the_full_rate_from_the_first_update():
    rank = critic_rank("critic.lr=3e-3", "critic.warmup_steps=0")
    start(rank)
    rank.set_version(2)  # nothing to seek
    assert [lr_of_next_update(rank) for _ in range(2)] == [3e-3, 3e-3]


# ------------------------------------------------------------------------------------------ the checkpoint


def test_a_critic_checkpoint_holds_its_version_and_rng_states_as_a_policy_one_does(tmp_path):
    rank = critic_rank()
    start(rank)
    lr_of_next_update(rank)  # one AdamW step, so the digest has moments to compare
    rank.version = 3
    saved = rank.save_state(str(tmp_path))
    # the policy's tag and RNG file; the version rides in DeepSpeed's client state
    assert rank.engine.saved == {(str(tmp_path), "ds"): {"version": 3}}
    assert (tmp_path / "rng_rank0.pt").is_file()
    assert saved["version"] == 3 and saved["step"] == 1.0 and saved["exp_avg_abs_sum"] > 0
    draws = [random.random(), float(torch.rand(1))]
    rank.version = 0
    assert rank.load_state(str(tmp_path)) == saved
    assert rank.version == 3
    assert [random.random(), float(torch.rand(1))] == draws  # the RNG states came back


def test_a_missing_checkpoint_names_the_critic_rank_and_the_folder(tmp_path):
    rank = critic_rank()
    start(rank)
    with pytest.raises(RuntimeError, match=f"critic rank 0: DeepSpeed found no checkpoint `ds` in {tmp_path}"):
        rank.load_state(str(tmp_path))


# --------------------------------------------------------------------------------- the plan and the merge


def batch_of(lengths: list[int]) -> TrainingBatch:
    """Samples of a 2-token prompt and responses of `lengths` tokens (so sample i holds 2 + lengths[i] tokens)."""
    return TrainingBatch.from_samples([[1, 2]] * len(lengths), [[5] * n for n in lengths])


def test_the_critic_plans_its_ranks_with_the_learners_plan_even_when_they_do_not_divide_the_batch():
    # 5 samples of 7, 3, 7, 3, 5 tokens over 2 critic ranks, critic.micro_batch_size 2. Sorted by tokens the seeds
    # are {1, 3}, {4, 0} and {2} (7 tokens against an empty part: the largest difference, merged first). {2} meets
    # {4, 0} crosswise: {2, 4} = 12 and {0} = 7; that meets {1, 3}: {2, 3, 4} = 15 and {0, 1} = 10 tokens, 3 and 2
    # samples (round-robin's {0, 2, 4} | {1, 3} held 19 and 6).
    cfg = load_config(None, ["algorithm.preset=ppo", "critic.num_workers=2", "critic.micro_batch_size=2"])
    plan = plan_batch(batch_of([5, 1, 5, 1, 3]), MicroBatching.of_critic(cfg), 2)
    assert plan.shards == [[0, 1], [2, 3, 4]]
    # 3 samples need 2 micro-batches of at most 2; the other rank's 2 samples fill one and run a padding one
    assert plan.micro_batches == [[[0, 1], []], [[0, 1], [2]]]


def test_the_critics_micro_batches_follow_critic_settings_not_the_learners():
    cfg = load_config(None, ["algorithm.preset=ppo", "critic.num_workers=1", "critic.micro_batch_size=3",
                             "learner.micro_batch_size=1", "learner.max_tokens_per_micro_batch=8"])
    assert MicroBatching.of_critic(cfg) == MicroBatching(micro_batch_size=3, max_tokens=0, padded=True)
    assert plan_batch(batch_of([1, 2, 3, 4]), MicroBatching.of_critic(cfg), 1).micro_batches == [[[0, 1, 2], [3]]]


def test_merge_rows_puts_each_ranks_rows_back_in_batch_order():
    # rank 0 holds samples 0 and 2 (responses of 1 and 3 tokens), rank 1 sample 1 (2 tokens); each rank's rows are
    # as wide as its own longest response
    batch = batch_of([1, 2, 3])
    plan = BatchPlan(shards=[[0, 2], [1]], micro_batches=[[[0, 1]], [[0]]])
    rows = [torch.tensor([[1.0, 0.0, 0.0], [3.0, 3.5, 4.0]]), torch.tensor([[2.0, 2.5]])]
    torch.testing.assert_close(merge_rows(batch, plan, rows),
                               torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.5, 0.0], [3.0, 3.5, 4.0]]))
