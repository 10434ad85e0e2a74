"""Run-config sections of the optional model worker groups beside the learner: the critic (PPO's value model,
trained), the reference policy (frozen, scores KL terms) and the teacher (frozen, scores tokens for on-policy
distillation). Each is a Ray actor group with its own placement."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray defines itself; the per-role custom resource maps must not name them."""


def check_custom_resources(section: str, value: dict[str, float]) -> dict[str, float]:
    """`value`, a frozen-model worker group's `<section>.resources`, if it names only custom resources, each > 0."""
    for name, amount in value.items():
        if name in RAY_BUILTIN_RESOURCES:
            raise ValueError(
                f"{section}.resources names the built-in resource {name!r}; set CPUs with {section}.cpus and GPUs "
                f"with {section}.gpus; custom resources are the names given to `ray start --resources`")
        if not amount > 0:
            raise ValueError(f"{section}.resources.{name}={amount} must be > 0")
    return value


class CriticConfig(BaseModel):
    """The critic worker group (PPO's value model): the policy's causal LM body plus a scalar head, DeepSpeed
    data-parallel ranks with their own optimizer. Each rank also stamps values on trajectories streaming toward
    the replay queue. Needed by advantage.type=gae (preset ppo); 0 workers starts none."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(0, ge=0, le=1024)
    """Critic ranks (one Ray actor each, one GPU each on GPUs). 0: no critic (every critic-free preset). The
    ranks train together (ZeRO-2 data parallel) and each serves value requests from the stream on its own."""

    model_path: str = ""
    """Hugging Face folder the value model's body is loaded from (AutoModel: the causal LM without its LM head).
    Empty: the policy's own folder (model.path or the demo model). Its tokenizer and vocabulary must equal the
    policy's. A `value_head.pt` in the folder (written by a saved critic) restores the head too."""

    lr: float = Field(1e-4, gt=0, le=1.0)
    """AdamW learning rate of the critic after warm-up. The critic's head starts from zero, so it may learn
    faster than the policy."""

    warmup_steps: int = Field(5, ge=0, le=1_000_000)
    """Critic updates over which its learning rate rises linearly to lr: update k (from 1) uses
    lr * min(1, k / warmup_steps), the policy's rule (learner.lr_warmup_steps). 0: none."""

    weight_decay: float = Field(0.0, ge=0, le=1.0)
    """AdamW weight decay of the critic."""

    max_grad_norm: float = Field(1.0, gt=0, le=1e6)
    """Global gradient norm clip of the critic."""

    value_clip: float | None = Field(0.2, gt=0, le=1e6)
    """Clipped value loss (OpenAI baselines ppo2): the new value may move at most this far from the value
    stamped at sampling time before the loss stops rewarding it. None: plain squared error."""

    head_init_std: float = Field(0.0, ge=0, le=1.0)
    """Std of the value head's initial weights (bias 0). 0 (default) starts every value at 0, so the first
    advantages are plain returns and the body's features are not disturbed before the head has learned."""

    zero_stage: Literal[2] = 2
    """DeepSpeed ZeRO stage of the critic ranks: 2 shards optimizer state and gradients. Stage 3 is not offered:
    values for the stream are computed by one rank at a time, and ZeRO-3's parameter gathers need every rank."""

    micro_batch_size: int = Field(64, ge=1, le=65_536)
    """Samples per forward/backward of the critic (its values pass and its update)."""

    cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs reserved per critic rank (its placement bundle, beside its GPU on GPU runs)."""

    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each critic rank's bundle asks for, to pin the critic to chosen nodes."""

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"critic.resources names the built-in resource {name!r}; set CPUs with critic.cpus "
                                 "and GPUs with cluster.use_gpus")
            if not amount > 0:
                raise ValueError(f"critic.resources.{name}={amount} must be > 0")
        return value

    @property
    def enabled(self) -> bool:
        return self.num_workers > 0


class ReferenceConfig(BaseModel):
    """The reference worker group: actors that hold the frozen reference policy (the initial model) and add
    reference log-probs to trajectories while they stream toward the replay queue, so learner ranks hold no
    second copy of the model. Plain data parallel: each worker holds the whole model and scores whole groups."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int = Field(0, ge=0, le=1024)
    """Reference workers. 0 keeps the reference model inside every learner rank (fine for small models; it
    doubles the learner's weight memory). Above 0 the workers score every group in parallel with its reward,
    and the KL in the loss and in the reward both read those log-probs. Only runs with a KL term
    (algorithm.kl.beta > 0) may set it; others are refused, since nothing would read the log-probs."""

    cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs reserved per reference worker (its placement bundle). On CPU-only runs its forward passes run
    within them."""

    gpus: float = Field(1.0, gt=0, le=8)
    """GPUs reserved per reference worker when cluster.use_gpus is true (ignored otherwise). A fraction lets
    workers share a GPU: the worker holds one copy of the weights and one micro-batch of activations."""

    max_tokens_per_micro_batch: int = Field(0, ge=0, le=16_777_216)
    """Token budget (prompt + response) of one reference forward; 0 scores in the learner's micro-batches
    (learner.micro_batch_size or learner.max_tokens_per_micro_batch). A reference worker keeps no gradients,
    optimizer state or activations for a backward pass, so on its own GPU it can take several times the
    learner's budget: fewer, fuller forwards. The log-probs do not depend on it. A sample longer than the budget
    is scored alone, never truncated."""

    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each reference worker's bundle asks for (per worker), to pin the group to chosen
    nodes, e.g. `{rollout_node: 1}` to keep it beside the engines whose groups it scores."""

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        return check_custom_resources("reference", value)


class TeacherConfig(BaseModel):
    """The teacher worker group for on-policy distillation: actors that hold a frozen teacher model and add its
    log-probs of every sampled token to trajectories while they stream toward the replay queue, beside the reward
    (learner/distillation.py reads them; algorithm.distillation.weight mixes them with the verifier's reward).
    Plain data parallel, as the reference workers: each worker holds the whole teacher and scores whole groups."""

    model_config = ConfigDict(extra="forbid")

    path: str = ""
    """Hugging Face folder of the teacher (a stronger model on the same task: larger, or trained longer). Its
    tokenizer must equal the student's (the run checks before any actor starts): the teacher scores the student's
    own token ids. Empty: no teacher."""

    num_workers: int = Field(0, ge=0, le=1024)
    """Teacher workers. 0: no teacher. One worker per engine's worth of groups is plenty on small models; raise it
    when `teacher_worker/seconds_per_group` approaches the time an engine takes to generate a group."""

    cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs reserved per teacher worker (its placement bundle). On CPU-only runs its forward passes run within
    them."""

    gpus: float = Field(1.0, gt=0, le=8)
    """GPUs reserved per teacher worker when cluster.use_gpus is true (ignored otherwise). A fraction lets workers
    share a GPU: the worker holds one copy of the teacher and one micro-batch of activations."""

    max_tokens_per_micro_batch: int = Field(0, ge=0, le=16_777_216)
    """Token budget (prompt + response) of one teacher forward; 0 scores in the learner's micro-batches. The
    teacher runs no backward, so on its own GPU it can take several times the learner's budget. A sample longer
    than the budget is scored alone, never truncated."""

    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each teacher worker's bundle asks for, to pin the group to chosen nodes."""

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        return check_custom_resources("teacher", value)

    @model_validator(mode="after")
    def _path_and_workers(self) -> "TeacherConfig":
        if self.num_workers > 0 and not self.path:
            raise ValueError(f"teacher.num_workers={self.num_workers} but teacher.path is empty: give the teacher's "
                             "Hugging Face folder (teacher.path=/path/to/teacher), or set teacher.num_workers=0")
        if self.path and self.num_workers == 0:
            raise ValueError(f"teacher.path={self.path!r} but teacher.num_workers=0, so no worker would score with "
                             "it. Set teacher.num_workers=1 (or more), or remove teacher.path")
        return self

    @property
    def enabled(self) -> bool:
        return self.num_workers > 0
