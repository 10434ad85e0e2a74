"""The learning-rate schedule of every trained model (the policy's and the critic's): a linear warm-up counted in
optimizer steps (several per batch with learner.ppo_epochs or learner.mini_batches_per_step above 1). Pure;
learner/rank_template.py hands it to DeepSpeed, which steps it once per optimizer step (at each
gradient-accumulation boundary).
"""

import torch


def warmup_factor(completed_steps: int, warmup_steps: int) -> float:
    """LR multiplier of the optimizer step that follows `completed_steps` steps: (k + 1) / warmup_steps up to 1, so
    the first step already moves (lr / warmup_steps) and step warmup_steps is the first at the full lr."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (completed_steps + 1) / warmup_steps)


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int,
                    completed_steps: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR of warmup_factor, standing after `completed_steps` optimizer steps (a critic group restarted at
    its version continues its warm-up); step it once after every optimizer step (DeepSpeed does)."""
    for group in optimizer.param_groups:  # what LambdaLR itself records when it starts from step 0
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: warmup_factor(k, warmup_steps),
                                             last_epoch=completed_steps - 1)
