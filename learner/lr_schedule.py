"""The learning-rate schedule of every trained model (the policy's and the critic's): a linear warm-up, then, for
the policy, an optional half-cosine decay, both counted in optimizer steps (several per batch with
learner.ppo_epochs or learner.mini_batches_per_step above 1). Pure; learner/rank_template.py hands it to DeepSpeed,
which steps it once per optimizer step (at each gradient-accumulation boundary).
"""

import math

import torch


def warmup_factor(completed_steps: int, warmup_steps: int) -> float:
    """LR multiplier of the optimizer step that follows `completed_steps` steps: (k + 1) / warmup_steps up to 1, so
    the first step already moves (lr / warmup_steps) and step warmup_steps is the first at the full lr."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (completed_steps + 1) / warmup_steps)


def schedule_factor(completed_steps: int, warmup_steps: int, decay_steps: int = 0,
                    min_ratio: float = 0.0) -> float:
    """LR multiplier of optimizer step n = completed_steps + 1: the warm-up (warmup_factor) up to step
    warmup_steps, then a half cosine from 1 to `min_ratio` over the next `decay_steps` steps (Loshchilov & Hutter
    2017, SGDR, one cycle without restarts): step warmup_steps + j uses
    min_ratio + (1 - min_ratio) * (1 + cos(pi * j / decay_steps)) / 2, so the last decay step is at min_ratio,
    and every later step stays there. decay_steps 0: no decay."""
    into_decay = completed_steps + 1 - max(warmup_steps, 0)
    if decay_steps <= 0 or into_decay <= 0:
        return warmup_factor(completed_steps, warmup_steps)
    progress = min(1.0, into_decay / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, completed_steps: int = 0,
                    decay_steps: int = 0, min_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR of schedule_factor, standing after `completed_steps` optimizer steps (a critic group restarted at
    its version continues its warm-up); step it once after every optimizer step (DeepSpeed does)."""
    for group in optimizer.param_groups:  # what LambdaLR itself records when it starts from step 0
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: schedule_factor(k, warmup_steps, decay_steps, min_ratio), last_epoch=completed_steps - 1)
