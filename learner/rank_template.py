"""The DeepSpeed rank every trained model runs on: the policy's learner ranks (learner/learner_actor.py) and the
critic's (learner/critic_rank.py) fill in this template with their model and the forward + loss of one micro-batch.

The template holds the rest: the engine with its AdamW and the warm-up schedule (learner/lr_schedule.py), one
optimizer step as a loop over the micro-batches the driver planned (learner/batch_plan.py, padding ones included,
so every rank runs the same collectives), the accumulation boundary at the last one, each loss a share of the
global batch's (its global normalizer) scaled by the data-parallel size, a step skipped on every rank after a
non-finite loss (learner/nonfinite.py), and the checkpoint with the RNG states (learner/rank_checkpoint.py).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from learner.lr_schedule import warmup_schedule
from learner.nonfinite import agree, check_skipped, is_nonfinite, poison
from learner.rank_checkpoint import RankCheckpoint
from learner.rank_setup import DeepSpeedRank
from protocols.config import RunConfig
from protocols.metrics import combine_metrics

ForwardAndLoss = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor, dict[str, float]]]
"""A rank's part of one micro-batch, samples `idx` of its shard (an empty list: a padding micro-batch):
(the loss, already the micro-batch's share of the global batch's loss; a tensor with a gradient path into the
model, which `poison` makes non-finite when the step is skipped (the log-probs, the values); the micro-batch's
metric sums)."""


@dataclass
class StepReadings:
    """What one optimizer step reads off the engine, for the rank to report under its own metric names."""

    lr: float
    """The learning rate the step used (the schedule moves on at the step's boundary)."""
    grad_norm: float
    """The global gradient norm before clipping (0.0 where DeepSpeed gives none; NaN or inf when skipped)."""


def run_micro_batches(engine, plan: list[list[int]], forward_and_loss: ForwardAndLoss, data_parallel_size: int,
                      device: torch.device, summed: dict[str, float]) -> tuple[dict[str, float], float, bool]:
    """One optimizer step over the micro-batches of `plan`; (the metric sums added to `summed`, the learning rate
    the step used, whether any rank saw a non-finite loss). Every rank of the group calls it together with a plan
    of the same length."""
    # What engine.set_train_batch_size writes, with data-parallel groups counted instead of ranks: DeepSpeed 0.19's
    # own call fails under a Ulysses mpu (its engine.dp_world_size is None there). The boundary is set explicitly
    # below, so a count that changes between steps never meets a stale micro-step counter.
    engine._config.train_batch_size = len(plan) * data_parallel_size
    engine._config.gradient_accumulation_steps = len(plan)
    lr = engine.get_lr()[0]
    engine.train()
    nonfinite = False
    for k, idx in enumerate(plan):
        last = k == len(plan) - 1
        loss, anchor, metrics = forward_and_loss(idx)
        nonfinite = nonfinite or is_nonfinite(loss)
        if last:
            # Before the step's last backward every rank agrees (all-reduce) and, if any saw a non-finite loss,
            # makes its gradient non-finite, so the optimizer's global norm check skips the update on every rank.
            nonfinite = agree(nonfinite, device)
            if nonfinite:
                loss = poison(loss, anchor)
        engine.set_gradient_accumulation_boundary(last)
        # DeepSpeed averages gradients over data-parallel groups (and sums them over a group's sequence-parallel
        # ranks); the loss is this micro-batch's share of the global one, so the summed gradient is the same for
        # any split of the batch.
        engine.backward(loss * data_parallel_size, scale_wrt_gas=False)
        engine.step()
        summed = combine_metrics([summed, metrics])
        del loss, anchor
    return summed, lr, nonfinite


class TrainingRank(DeepSpeedRank, RankCheckpoint):
    """A DeepSpeed rank that trains a model. The checkpoint and state methods (save_state, load_state,
    optimizer_digest, state_snapshot) come from learner/rank_checkpoint.py."""

    role = "learner"
    """How errors and checkpoints name this kind of rank."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str,
                 sequence_parallel_size: int = 1) -> None:
        super().__init__(cfg, rank, world_size, model_path)
        self.sp = sequence_parallel_size
        self.data_parallel_size = world_size // sequence_parallel_size
        """Data-parallel groups (ranks, or groups of sp ranks sharing one shard): the loss scale."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.warmup_steps = 0
        self.decay_steps, self.min_ratio = 0, 0.0
        self.skipped_nonfinite = 0
        """Updates skipped because the loss or the gradient norm was NaN or infinite (learner/nonfinite.py)."""

    def _start_engine(self, deepspeed, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ds_config: dict,
                      warmup_steps: int, completed_steps: int = 0, mpu=None, decay_steps: int = 0,
                      min_ratio: float = 0.0) -> None:
        """deepspeed.initialize with the schedule (warm-up, then the policy's optional cosine decay) standing after
        `completed_steps` optimizer steps. `deepspeed` is the module, passed in because only the rank files import
        DeepSpeed."""
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self.decay_steps, self.min_ratio = decay_steps, min_ratio
        # DeepSpeed steps the schedule at every accumulation boundary, i.e. once per optimizer step.
        schedule = (warmup_schedule(optimizer, warmup_steps, completed_steps, decay_steps, min_ratio)
                    if warmup_steps or decay_steps else None)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                               config=ds_config, mpu=mpu)

    def _seek_schedule(self, completed_steps: int) -> None:
        """Put the warm-up where it stands after `completed_steps` optimizer steps (a restarted critic group keeps
        its version, and its warm-up goes on from there)."""
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler = warmup_schedule(self.optimizer, self.warmup_steps, completed_steps,
                                                       self.decay_steps, self.min_ratio)

    def _optimizer_step(self, plan: list[list[int]], forward_and_loss: ForwardAndLoss,
                        summed: dict[str, float] | None = None) -> tuple[dict[str, float], StepReadings]:
        """One optimizer step on the micro-batches of `plan` (see run_micro_batches); the summed metrics and the
        step's readings. Raises if the ranks agreed to skip but the optimizer applied the step."""
        summed, lr, nonfinite = run_micro_batches(self.engine, plan, forward_and_loss, self.data_parallel_size,
                                                  self._device(), summed or {})
        grad_norm = self.engine.get_global_grad_norm()
        # A NaN/inf loss or gradient norm: the optimizer dropped the step (weights and moments unchanged).
        self.skipped_nonfinite += check_skipped(nonfinite, grad_norm)
        return summed, StepReadings(lr=float(lr), grad_norm=float(grad_norm) if grad_norm is not None else 0.0)
