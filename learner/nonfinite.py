"""Skipping an update whose loss or gradient norm is NaN or infinite, the same way on every learner rank.

A rank that sees a non-finite micro-batch loss raises a flag; before the last backward of the step the flags are
all-reduced (MAX), so every rank knows the step is skipped. Skipping itself is the optimizer's: DeepSpeed's ZeRO
optimizers (stages 1-3, fp32 and bf16) compute the global gradient norm, all-reduced over the ranks, and drop the
step when it is not finite (gradients cleared, weights and Adam moments untouched). A rank whose loss was
non-finite while its gradients were not makes its last backward non-finite too (`poison`), so the global norm
carries the decision; the rank then checks the optimizer did skip (`check_skipped`) rather than trusting it.
"""

import math

import torch


def is_nonfinite(loss: torch.Tensor) -> bool:
    """True when the micro-batch loss has a NaN or an infinity."""
    return not bool(torch.isfinite(loss.detach()).all())


def agree(flag: bool, device: torch.device) -> bool:
    """The MAX of `flag` over every rank of the default process group (a no-op with one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def poison(loss: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """`loss` whose gradient is NaN wherever `logprobs` has a gradient path, so the optimizer's non-finite norm
    check skips the step on every rank."""
    return loss + float("nan") * logprobs.sum()


def check_skipped(step_nonfinite: bool, grad_norm: float | None) -> bool:
    """Whether the optimizer skipped this step (its global gradient norm is not finite). Raises when the ranks
    agreed to skip but the optimizer applied the step: the weights are then no longer trustworthy."""
    skipped = grad_norm is not None and not math.isfinite(float(grad_norm))
    if step_nonfinite and not skipped:
        raise RuntimeError(
            f"a non-finite loss was seen, but the optimizer applied the step (global grad norm {grad_norm}); this "
            "DeepSpeed version does not skip non-finite steps. Keep learner.max_grad_norm > 0 (the norm check "
            "runs with gradient clipping) and use a DeepSpeed ZeRO optimizer that checks the norm (0.19 does)")
    return skipped
