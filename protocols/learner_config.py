"""The learner section of the run config: DeepSpeed ranks, micro-batching by samples or tokens, packing, the
chunked LM head, checkpointing, sequence parallelism, several updates per batch and the optimizer."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_ranks: int = Field(1, ge=1)
    """Data-parallel DeepSpeed ranks (one Ray actor each)."""

    zero_stage: Literal[2, 3] = 2
    """DeepSpeed ZeRO stage: 2 shards optimizer state and gradients, 3 also the parameters."""

    prompts_per_step: int = Field(16, ge=1)
    """Groups (prompts) in one global batch; the batch holds prompts_per_step * samples_per_prompt samples."""

    micro_batch_size: int = Field(64, ge=1)
    """Samples per forward/backward on one rank when max_tokens_per_micro_batch is 0; gradients accumulate over
    micro-batches."""

    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Token budget (prompt + response) of one micro-batch; 0 uses micro_batch_size samples instead. With a
    budget, ranks get about equal token loads and each rank's samples fill micro-batches of about equal token
    counts, so long-tailed lengths neither pad nor run out of memory; the number of micro-batches follows the
    batch. A sample longer than the budget gets a micro-batch of its own (never truncated). Long-CoT runs: a
    few times the longest prompt + response, e.g. 32768."""

    packing: bool = False
    """Put a micro-batch's samples in one row without padding (positions restart per sample; attention stays
    inside each sample: flash-attention varlen on GPU, a block-diagonal mask on CPU). Pair it with
    max_tokens_per_micro_batch; metrics report learner/effective_token_frac either way."""

    logits_chunk_tokens: int = Field(2048, ge=0)
    """Positions scored through the LM head at once (fp32 log-sum-exp, recomputed in backward), so the
    (tokens x vocabulary) logits never exist whole: at a 151k vocabulary they cost 0.6 MB per token in fp32,
    18.5 GiB at 32k tokens. 2048 keeps a chunk's buffers near 3 GiB there (two fp32 copies of its logits plus
    the matmul output), while each head matmul (2048 x hidden x vocabulary) stays large enough to run at full
    speed. 0 materializes all logits (the original path, for comparison)."""

    lr: float = Field(5e-5, gt=0)
    """AdamW learning rate."""

    lr_warmup_steps: int = Field(0, ge=0, le=10_000_000)
    """Optimizer steps over which the learning rate rises linearly to `lr`: step k (from 1) uses
    lr * min(1, k / lr_warmup_steps). Counted in optimizer steps, not batches: a batch takes ppo_epochs *
    mini_batches_per_step of them. 0: the full lr from the first step."""

    lr_decay_steps: int = Field(0, ge=0, le=10_000_000)
    """Optimizer steps after the warm-up over which the learning rate falls from `lr` to `lr * lr_min_ratio` along
    a half cosine (learner/lr_schedule.py), then stays there; counted like lr_warmup_steps (train.steps times
    ppo_epochs * mini_batches_per_step for the whole run). 0 (default): no decay. A decay lets a run take large
    steps early and settle late: on the distillation demo, 2e-4 decayed over the run (docs/distillation.md)."""

    lr_min_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """The learning rate at the end of the decay, as a fraction of `lr` (0 to 1; default 0: down to zero). Read
    only with lr_decay_steps > 0."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    fused_adamw: bool = True
    """On GPUs, torch's fused AdamW: one kernel updates all parameters and moments instead of a handful of
    element-wise passes over them (1.5B shape on an H200: 1.3 to 1.7% faster steps at 8k and 32k). The same
    update; on CPU ranks it is ignored."""

    max_grad_norm: float = Field(1.0, gt=0)
    """Global gradient norm clip."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory on long responses."""

    uncheckpointed_layers: int = Field(0, ge=0)
    """With gradient_checkpointing on, the last N decoder layers keep their activations instead of recomputing
    them: each one costs its activations' memory (about 3 GiB per layer at 32k tokens for the 1.5B shape) and
    saves its share of the recompute (about 1/num_layers of a sixth of the step). Raise it while memory allows."""

    checkpoint_keeps_attention: bool = True
    """With gradient_checkpointing on, a checkpointed layer still keeps its attention kernel's output (one
    tokens x hidden tensor and a log-sum-exp per head: about 100 MB per layer at 32k tokens for the 1.5B shape,
    2.8 GiB over its 28 layers) so backward recomputes the projections, norms and MLP but not attention, whose
    cost grows with length squared and is about half a layer's forward at 32k. False recomputes it too."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend: auto is nccl with GPUs, gloo on CPU."""

    ppo_epochs: int = Field(1, ge=1, le=64)
    """Passes over each global batch. Every pass shuffles the batch (seeded by train.seed and the batch's index)
    and takes one optimizer step per mini-batch, so a batch makes ppo_epochs * mini_batches_per_step updates and
    the policy version still advances once. Above 1 the PPO clip bounds how far the later passes move (in
    decoupled mode against the proximal log-probs recomputed once before the first update). 1 to 4 is usual."""

    mini_batches_per_step: int = Field(1, ge=1, le=1024)
    """Optimizer steps per pass over the global batch: each pass splits it into this many mini-batches of about
    equal sample counts, each with its own loss normalizers (token and sequence counts of that mini-batch), then
    split over the ranks and into micro-batches as a whole batch would be. With max_tokens_per_micro_batch 0 a
    mini-batch must split evenly over the data-parallel groups. 1 is one update per pass (the default)."""

    sequence_parallel_size: int = Field(1, ge=1)
    """Ranks that share one sample, each holding a 1/sequence_parallel_size slice of its tokens (Ulysses sequence
    parallelism, as in DeepSpeed's ALST): attention swaps sequence slices for head slices with an all-to-all.
    Raise it when one response no longer fits on one device. num_ranks must be a multiple of it: the batch is
    split over num_ranks / sequence_parallel_size data-parallel groups. A group's micro-batch is one packed row
    (whatever `packing` says) of up to max_tokens_per_micro_batch tokens, each rank holding 1/size of it. The
    model's attention heads (and its KV heads, or sequence_parallel_size divided by them) must split evenly over
    it. ZeRO-2 only. 1 turns it off."""

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> "LearnerConfig":
        if self.num_ranks % self.sequence_parallel_size:
            raise ValueError(
                f"learner.sequence_parallel_size={self.sequence_parallel_size} does not divide "
                f"learner.num_ranks={self.num_ranks}: the ranks form num_ranks / sequence_parallel_size "
                f"data-parallel groups of sequence_parallel_size ranks each. Use a num_ranks that is a multiple of "
                f"{self.sequence_parallel_size}, or a sequence_parallel_size that divides {self.num_ranks}"
            )
        return self
