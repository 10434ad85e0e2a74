"""The demos' supervised warm start: one loop that trains a tiny policy on teacher-forced examples so that RL starts
from a partly able model, and the greedy decoding its accuracy checks use. demos/arithmetic_model.py (addition,
products with the calculator) and demos/longcot_model.py (written-out multiplication) hand it their examples as
micro-batches and their check; it returns the trained model's losses and last check, and saves nothing.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from protocols.trajectory import Prompt, VerifierResult

MicroBatches = Callable[[list[int], torch.Generator], list[tuple[torch.Tensor, torch.Tensor]]]
"""A step's rows (indices into the demo's training examples, drawn by the warm start) -> right-padded `(input_ids,
loss_mask)` micro-batches, `(B, T)` each, the mask True on the target tokens. The generator is the warm start's,
for a draw of the demo's own after the rows' (the tool demo's choice of the rows that call the tool)."""

Check = Callable[[Qwen2ForCausalLM], tuple[bool, dict[str, float]]]
"""The model, in eval mode -> whether it is at the demo's target, and the figures to log (with `accuracy`)."""


@dataclass
class WarmStartResult:
    losses: list[float]
    """Each step's loss: the mean over the batch's target tokens."""
    check: dict[str, float]
    """The last check's figures; empty when no check ran."""
    seconds: float
    """Wall time of the loop, checks included."""
    cpu_seconds_per_step: float
    """Process CPU seconds of a training step, checks left out: wall time is noisy on a shared machine."""

    def stats(self) -> dict[str, float]:
        """The figures every demo writes into its ready marker (the last loss: a mean over up to 20 steps)."""
        last = self.losses[-20:]
        return {
            "warm_start/steps": float(len(self.losses)),
            "warm_start/loss_first": self.losses[0] if self.losses else float("nan"),
            "warm_start/loss_last": sum(last) / len(last) if last else float("nan"),
            "warm_start/seconds": self.seconds,
        }


def supervised_warm_start(
    model: Qwen2ForCausalLM,
    num_examples: int,
    micro_batches: MicroBatches,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    check: Check | None = None,
    check_every: int = 10,
    max_grad_norm: float | None = None,
    name: str = "warm start",
    log: Callable[[str], None] | None = None,
    progress: bool = False,
) -> WarmStartResult:
    """Train `model` in place, AdamW at `lr` without weight decay, for up to `steps` steps of `batch_size` rows drawn
    with replacement from `num_examples` (torch.randint on a generator seeded with `seed`). A step's loss is the
    cross-entropy of the next token on the masked targets, averaged over all the batch's targets whichever
    micro-batch holds them; `max_grad_norm` clips the gradient's norm first (None: no clipping).

    With `check`, the model is checked every `check_every` steps and after the last, and training stops once two
    checks in a row are at the target: where the accuracy jumps depends much on the seed, so a fixed step count
    would start RL anywhere on the curve, and at these learning rates it swings by about 5 points between checks,
    so one lucky check would stop below the target. `log` gets one line per check; `progress` shows a bar named
    `name`. The model is left in eval mode.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    start = time.perf_counter()
    losses: list[float] = []
    figures: dict[str, float] = {}
    checks_at_target = 0
    train_cpu = 0.0
    bar = tqdm(total=steps, desc=name, dynamic_ncols=True, disable=not progress)
    for step in range(1, steps + 1):
        cpu_start = time.process_time()
        model.train()
        rows = torch.randint(0, num_examples, (batch_size,), generator=generator).tolist()
        parts = micro_batches(rows, generator)
        # Targets are the next tokens, so the mask moves with them: column 0 (BOS) is never a target.
        targets = sum(int(loss_mask[:, 1:].sum()) for _, loss_mask in parts)
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for input_ids, loss_mask in parts:
            # No attention mask: padding is on the right and attention is causal, so no real token sees a pad.
            logits = model(input_ids=input_ids[:, :-1]).logits
            token_loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none")
            loss = (token_loss * loss_mask[:, 1:].reshape(-1).float()).sum() / targets
            loss.backward()
            loss_sum += loss.item()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(loss_sum)
        train_cpu += time.process_time() - cpu_start
        bar.update(1)
        if check is not None and (step % check_every == 0 or step == steps):
            model.eval()
            at_target, figures = check(model)
            if log is not None:
                log(f"{name} step {step}: loss {loss_sum:.4f}, check "
                    + ", ".join(f"{key} {value:.3f}" for key, value in figures.items())
                    + f", {time.perf_counter() - start:.0f} s, {train_cpu / step:.2f} CPU s per training step")
            bar.set_postfix(loss=f"{loss_sum:.3f}", check=f"{figures['accuracy']:.2f}")
            checks_at_target = checks_at_target + 1 if at_target else 0
            if checks_at_target == 2:
                break
    bar.close()
    model.eval()
    return WarmStartResult(losses=losses, check=figures, seconds=time.perf_counter() - start,
                           cpu_seconds_per_step=train_cpu / max(1, len(losses)))


@torch.no_grad()
def greedy_responses_hf(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> list[str]:
    """Greedy responses as text (special tokens dropped), with transformers `generate` on left-padded batches."""
    texts: list[str] = []
    pad_id = tokenizer.pad_token_id
    for begin in range(0, len(prompts), batch_size):
        chunk = prompts[begin : begin + batch_size]
        width = max(len(p.prompt_token_ids) for p in chunk)
        # Left padding so every row's next token follows its own prompt directly.
        input_ids = torch.tensor([[pad_id] * (width - len(p.prompt_token_ids)) + p.prompt_token_ids for p in chunk])
        lengths = torch.tensor([len(p.prompt_token_ids) for p in chunk])
        attention_mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad_id,
        )
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def greedy_accuracy_hf(
    folder_or_model: str | Path | Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[Prompt],
    verifier: Callable[[Prompt, str], VerifierResult],
    max_new_tokens: int = 8,
) -> float:
    """Fraction of `prompts` whose greedy response the verifier marks correct."""
    if isinstance(folder_or_model, (str, Path)):
        model = Qwen2ForCausalLM.from_pretrained(str(folder_or_model), dtype=torch.float32)
    else:
        model = folder_or_model
    was_training = model.training
    model.eval()
    responses = greedy_responses_hf(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    model.train(was_training)
    if not prompts:
        return 0.0
    return sum(verifier(p, r).correct for p, r in zip(prompts, responses)) / len(prompts)
