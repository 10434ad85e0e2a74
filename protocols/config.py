"""The run config: one YAML file, validated here before any actor starts, overridable from the command line.

Sections mirror the actor groups: rollout, reward, learner, plus the algorithm, the data and the cluster.
`load_config` reads YAML, applies `a.b.c=value` overrides and reports unknown keys with the allowed ones.
"""

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocols.algorithm import DEFAULT_PRESET, AlgorithmConfig
from protocols.cluster_config import ClusterConfig
from protocols.data import DataConfig
from protocols.device_defaults import check_gpu_weight_sync, gpu_defaults
from protocols.fault import FaultConfig
from protocols.gateway import GatewayConfig
from protocols.learner_config import LearnerConfig
from protocols.model import ModelConfig
from protocols.model_workers import RAY_BUILTIN_RESOURCES, CriticConfig, ReferenceConfig, TeacherConfig
from protocols.reward import RewardConfig
from protocols.rollout_config import RolloutConfig
from protocols.tools import ToolsConfig
from protocols.weight_sync import CollectiveSync, ObjectStoreSync, SyncCheck, WeightSyncConfig

__all__ = ["RAY_BUILTIN_RESOURCES", "ClusterConfig", "CriticConfig", "LearnerConfig", "ReferenceConfig", "RolloutConfig",
           "RunConfig", "TeacherConfig", "load_config", "dump_config", "ConfigError"]


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(500, ge=1)
    """Global batches to train on, i.e. policy versions to publish. Each makes learner.ppo_epochs *
    learner.mini_batches_per_step optimizer steps (one with the defaults)."""

    max_staleness: int = Field(1, ge=0)
    """Max policy versions between a sample's oldest token and the learner; 0 is on-policy (synchronous).
    1 lets generation of the next batch overlap the learner step: on the demo it trained 1.6x faster than 0
    with the same held-out accuracy over three seeds. Long-tailed responses need more (see README)."""

    partial_rollouts: bool = True
    """With max_staleness > 0, in-flight requests continue under new weights instead of finishing on old ones."""

    eval_every: int = Field(0, ge=0)
    """Evaluate held-out accuracy every N steps (0: only before and after training)."""

    eval_sets: list[str] = Field(default_factory=list)
    """Held-out sets the evaluation harness (cluster/evaluation.py, as `relayrl eval`) runs every eval_every
    steps and after training, beside the run's own test split (`eval/accuracy`): `demo` (the arithmetic task),
    `gsm8k` (the shared GSM8K test file) or a JSONL/Parquet path read with data.prompt_field/answer_field. Each
    logs eval/<set>/accuracy (greedy) and eval/<set>/pass@k; data.num_eval_prompts prompts of each."""

    eval_samples: int = Field(4, ge=0, le=1024)
    """Sampled responses per prompt (at train.eval_temperature) on train.eval_sets, for pass@1 and pass@k with k
    = 1, 2, 4, ... up to it. Costs eval_samples generations per prompt per evaluation; 0: greedy accuracy only."""

    eval_temperature: float = Field(0.6, gt=0.0, le=2.0)
    """Sampling temperature of the pass@k samples (train.eval_sets and `relayrl eval`). 0.6 with top-p 0.95 is the
    pass@1 protocol of DeepSeek-R1 (sec. 3.1) that RLVR papers report; rollout.temperature (usually 1.0) is for
    exploration and puts more mass off the mode. Greedy accuracy is reported beside it either way."""

    eval_top_p: float = Field(0.95, gt=0.0, le=1.0)
    """Nucleus sampling of the pass@k samples (see eval_temperature)."""

    @field_validator("eval_sets")
    @classmethod
    def _check_eval_sets(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in ("demo", "gsm8k") and not name.endswith((".jsonl", ".parquet")):
                raise ValueError(f"train.eval_sets entry {name!r} is neither a built-in set (demo, gsm8k) nor a "
                                 "path ending in .jsonl or .parquet")
        stems = [Path(n).stem for n in value]
        if len(set(stems)) != len(stems):
            raise ValueError(f"train.eval_sets={value} names a set twice (sets are logged by name: "
                             "eval/<name>/...); give each once, or rename one of the files")
        return value

    save_every: int = Field(0, ge=0)
    """Write checkpoints/step_N every N steps (0: only the final model): the policy in HF format, the learner's
    DeepSpeed state (optimizer included) and RNG states, and the controller's state (data position, queued
    groups, groups in flight, counters); `relayrl train --resume RUN_DIR` continues from the newest one
    (layout in cluster/checkpoint.py)."""

    keep_checkpoints: int = Field(3, ge=1, le=1000)
    """Complete checkpoints kept; the oldest goes once a newer one is complete. Each holds the weights about
    four times (HF policy, DeepSpeed weights, two Adam moments), so large models want 1 or 2."""

    seed: int = 0
    """Seeds data order, sampling and initialization."""

    log_every: int = Field(1, ge=1)
    """Write metrics every N steps."""


class LoggingConfig(BaseModel):
    """Where a run's metrics go besides metrics.jsonl and TensorBoard (always written to the run folder), and
    whether its figures are drawn."""

    model_config = ConfigDict(extra="forbid")

    plots: bool = True
    """Draw the run's figures (RUN_DIR/plots/*.png, cli/plots.py) when it ends: about 4 s of CPU. `false`
    skips them; `relayrl plot RUN_DIR` draws them later from metrics.jsonl."""

    wandb: bool = False
    """Also log every metric to Weights & Biases, with the resolved config attached to the run. Needs the
    `wandb` package (a dependency); `wandb_mode: offline` needs no network or account."""

    wandb_project: str = Field("relayrl", min_length=1)
    """W&B project the run is logged under."""

    wandb_entity: str = ""
    """W&B team or user; empty uses the account's default."""

    wandb_name: str = ""
    """Run name shown in W&B; empty uses the run folder's name."""

    wandb_mode: Literal["online", "offline"] = "online"
    """`online` streams to the W&B server (needs `wandb login` or WANDB_API_KEY); `offline` writes the run under
    the run folder's `wandb/` (or $WANDB_DIR) for a later `wandb sync`. The WANDB_MODE variable overrides it."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    output_dir: str = "runs/demo"
    """Run folder: config.yaml, metrics.jsonl, TensorBoard events, checkpoints, final_model/, summary.json."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    """Tools the model may call while it reasons (multi-turn rollouts, protocols/tools.py); none: single-turn."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The session endpoint for agent programs (protocols/gateway.py, docs/agents.md); off by default."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    """Value model for GAE (preset ppo): `critic.num_workers: 1` turns it on."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Objective (see learner/ALGORITHMS.md). Without `preset`, a run uses DEFAULT_PRESET (dapo, the same default
    as AlgorithmConfig's own) under any fields given: on the demo, dynamic sampling (train only on groups with a
    signal) measured +18 points of held-out accuracy in 400 steps against +10 for grpo in 500."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    """Reference worker group (frozen reference policy for the KL term); 0 workers keeps it in the learner."""
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    """Teacher worker group for on-policy distillation (algorithm.distillation.weight); 0 workers: no teacher."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=ObjectStoreSync)
    """How new weights reach the rollout engines: `type: object_store` (default) or `type: collective`."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Experiment tracking beside TensorBoard: `logging.wandb: true` logs to Weights & Biases."""
    fault: FaultConfig = Field(default_factory=FaultConfig)
    """Worker failure: replacements allowed and the driver's wait limits."""

    @model_validator(mode="before")
    @classmethod
    def _default_preset(cls, data: Any) -> Any:
        # `algorithm.kl.beta=0` alone must not switch the run to another preset's defaults.
        if isinstance(data, dict) and isinstance(data.get("algorithm"), dict):
            data = {**data, "algorithm": {"preset": DEFAULT_PRESET, **data["algorithm"]}}
        if isinstance(data, dict) and isinstance(data.get("weight_sync"), dict):
            # `weight_sync.bucket_mb=64` alone tunes the default backend.
            data = {**data, "weight_sync": {"type": "object_store", **data["weight_sync"]}}
        return data

    @model_validator(mode="after")
    def _device_defaults(self) -> "RunConfig":
        """cluster.use_gpus: each device-dependent setting the user left unset takes its GPU value
        (protocols/device_defaults.py), and a weight transport that would not work on GPUs is refused. First of
        the checks, so that they see the values the run uses."""
        set_fields = {f"{section}.{name}" for section in ("model", "rollout")
                      for name in getattr(self, section).model_fields_set}
        if self.weight_sync.verify_tolerance is not None:
            set_fields.add("weight_sync.verify_tolerance")
        for dotted, value in gpu_defaults(self.cluster.use_gpus, set_fields, self.model.dtype).items():
            section, name = dotted.split(".")
            setattr(getattr(self, section), name, value)
        check_gpu_weight_sync(self.cluster.use_gpus, self.weight_sync.type, self.rollout.tensor_parallel_size)
        return self

    def _check_mini_batches(self, samples: int, groups: int, what: str) -> None:
        """Each mini-batch is split over the data-parallel groups like a whole batch (learner/update_plan.py)."""
        m = self.learner.mini_batches_per_step
        if m == 1:
            return
        if self.learner.max_tokens_per_micro_batch == 0 and samples % (m * groups):
            raise ValueError(
                f"learner.mini_batches_per_step={m} does not split the {samples} samples of a batch "
                f"(learner.prompts_per_step * rollout.samples_per_prompt) into mini-batches that divide evenly over "
                f"{what}: each mini-batch must hold a multiple of {groups} samples. Choose mini_batches_per_step so "
                f"{m} * {groups} divides {samples}, or set learner.max_tokens_per_micro_batch")
        if samples // m < groups:
            raise ValueError(
                f"learner.mini_batches_per_step={m} leaves mini-batches of {samples // m} samples (of {samples} per "
                f"batch), fewer than {what}: every group needs a sample of each mini-batch. Lower "
                f"mini_batches_per_step to at most {samples // groups}")

    @model_validator(mode="after")
    def _check_batch_split(self) -> "RunConfig":
        samples = self.learner.prompts_per_step * self.rollout.samples_per_prompt
        sp = self.learner.sequence_parallel_size
        groups = self.learner.num_ranks // sp
        # The batch is split over data-parallel groups (the SP ranks of a group share samples). Sample-count
        # micro-batches need equal shares; token-budget ones only one sample per group.
        what = f"learner.num_ranks={self.learner.num_ranks} / learner.sequence_parallel_size={sp} = {groups} " \
               f"data-parallel groups" if sp > 1 else f"learner.num_ranks={self.learner.num_ranks}"
        if self.learner.max_tokens_per_micro_batch == 0 and samples % groups:
            raise ValueError(
                f"learner.prompts_per_step * rollout.samples_per_prompt = {samples} samples do not split evenly "
                f"over {what}; choose prompts_per_step so the product is a multiple of {groups}, or set "
                f"learner.max_tokens_per_micro_batch (token-budget shares need not be equal)"
            )
        if samples < groups:
            raise ValueError(
                f"learner.prompts_per_step * rollout.samples_per_prompt = {samples} samples are fewer than "
                f"{what}: every group needs a sample. Raise prompts_per_step or lower num_ranks"
            )
        self._check_mini_batches(samples, groups, what)
        if sp > 1:
            self._check_sequence_parallel_algorithm(sp)
        if self.data.max_prompt_tokens + self.rollout.max_response_tokens > 1_000_000:
            raise ValueError("data.max_prompt_tokens + rollout.max_response_tokens exceeds 1M tokens")
        return self

    @model_validator(mode="after")
    def _check_critic(self) -> "RunConfig":
        """GAE needs a critic, and a critic needs GAE: refuse either half alone before any actor starts."""
        uses_values = self.algorithm.advantage.type == "gae"
        if uses_values and not self.critic.enabled:
            raise ValueError(
                f"algorithm.preset={self.algorithm.preset!r} uses algorithm.advantage.type=gae, which needs a critic's "
                f"values, but critic.num_workers=0. Set critic.num_workers=1 (or more), optionally critic.model_path "
                f"(default: the policy's folder), critic.lr and critic.warmup_steps; or choose a critic-free preset "
                f"(grpo, rloo, dr_grpo, dapo, gspo, cispo, reinforce, reinforce_pp)")
        if self.critic.enabled and not uses_values:
            raise ValueError(
                f"critic.num_workers={self.critic.num_workers} but algorithm.advantage.type="
                f"{self.algorithm.advantage.type!r} does not use values, so the critic would train for nothing. "
                f"Set critic.num_workers=0, or use algorithm.preset=ppo (advantage.type=gae)")
        return self

    @model_validator(mode="after")
    def _check_reference_workers(self) -> "RunConfig":
        if self.reference.num_workers > 0 and self.algorithm.kl.beta == 0:
            raise ValueError(
                f"reference.num_workers={self.reference.num_workers} but algorithm.kl.beta=0 (preset "
                f"{self.algorithm.preset!r} has no KL term): nothing would read the reference log-probs the workers "
                "compute. Set reference.num_workers=0, or give algorithm.kl.beta > 0 (e.g. preset grpo, rloo, "
                "reinforce_pp)")
        if self.reference.num_workers == 0 and self.reference.max_tokens_per_micro_batch > 0:
            raise ValueError(
                f"reference.max_tokens_per_micro_batch={self.reference.max_tokens_per_micro_batch} sets the reference "
                "workers' forward size, but reference.num_workers=0 (the in-learner reference scores in the "
                "learner's micro-batches). Set reference.num_workers > 0, or remove the setting")
        return self

    @model_validator(mode="after")
    def _check_teacher(self) -> "RunConfig":
        weight = self.algorithm.distillation.weight
        if weight > 0 and not self.teacher.enabled:
            raise ValueError(
                f"algorithm.distillation.weight={weight} trains on a teacher's log-probs, but teacher.num_workers=0. "
                "Set teacher.path=/path/to/teacher and teacher.num_workers=1, or algorithm.distillation.weight=0")
        if weight == 1.0 and self.algorithm.dynamic_sampling:
            raise ValueError(
                "algorithm.distillation.weight=1 (pure distillation) with algorithm.dynamic_sampling=true: dynamic "
                "sampling drops groups whose rewards are all equal, but under pure distillation every group carries "
                "the teacher's per-token signal, so they would be thrown away for nothing. Set "
                "algorithm.dynamic_sampling=false (or use a preset without it, e.g. grpo), or lower the weight")
        if self.rollout.samples_per_prompt == 1 and (weight < 1.0 or self.algorithm.advantage.type == "rloo"):
            raise ValueError(
                f"rollout.samples_per_prompt=1 with algorithm.distillation.weight={weight} and advantage type "
                f"{self.algorithm.advantage.type!r}: the verifier's advantage compares the samples of a group, so a "
                "group of one carries no reward signal (and rloo's leave-one-out baseline has no other sample). Set "
                "rollout.samples_per_prompt=2 or more, or algorithm.distillation.weight=1 (pure distillation) with a "
                "preset other than rloo")
        top_k = self.algorithm.distillation.top_k
        if top_k and weight == 0:
            raise ValueError(
                f"algorithm.distillation.top_k={top_k} ships the teacher's top-{top_k} tokens for a loss weighted by "
                "algorithm.distillation.weight=0, so they would travel for nothing. Set algorithm.distillation.weight "
                "above 0 (1: distillation only), or algorithm.distillation.top_k=0")
        if top_k and self.learner.sequence_parallel_size > 1:
            raise ValueError(
                f"algorithm.distillation.top_k={top_k} with learner.sequence_parallel_size="
                f"{self.learner.sequence_parallel_size}: the top-k loss is computed in the padded or packed forward "
                "only, not in a sequence-parallel slice. Set learner.sequence_parallel_size=1, or "
                "algorithm.distillation.top_k=0 (the sampled-token teacher advantage)")
        return self

    @model_validator(mode="after")
    def _check_gateway(self) -> "RunConfig":
        """The endpoint's settings that contradict each other, refused before any actor starts. Session groups
        pass the scoring stage as every group does (actors/scoring_stage.py), so reference, teacher and critic
        workers score them too."""
        if self.gateway.agent and not self.gateway.enabled:
            raise ValueError(
                f"gateway.agent={self.gateway.agent!r} with gateway.enabled=false: the agent plays its sessions on "
                "the rollout workers' endpoints; set gateway.enabled=true, or leave gateway.agent empty")
        if self.gateway.verifiers_env:
            self._check_verifiers_env()
        if self.gateway.outside_only:
            self._check_outside_only()
        return self

    def _check_verifiers_env(self) -> None:
        """gateway.verifiers_env is the in-process agent: it needs the endpoint and the run's own prompts."""
        g = self.gateway
        if not g.enabled:
            raise ValueError(
                f"gateway.verifiers_env={g.verifiers_env!r} with gateway.enabled=false: the environment's episodes "
                "play sessions of the rollout workers' endpoints; set gateway.enabled=true")
        if g.agent:
            raise ValueError(
                f"gateway.verifiers_env={g.verifiers_env!r} with gateway.agent={g.agent!r}: each is the run's "
                "in-process agent and a run has one; leave one of them empty")
        if g.outside_only:
            raise ValueError(
                f"gateway.verifiers_env={g.verifiers_env!r} with gateway.outside_only=true: the environment plays the "
                "prompts the run leases from its data set, and an outside-only run leases none. Set "
                "gateway.outside_only=false")

    def _check_outside_only(self) -> None:
        """gateway.outside_only: what needs the run's own prompts, refused before any actor starts."""
        if not self.gateway.enabled:
            raise ValueError(
                "gateway.outside_only=true with gateway.enabled=false: outside agents feed the run through the "
                "session endpoints, which gateway.enabled serves; set gateway.enabled=true")
        if self.gateway.agent:
            raise ValueError(
                f"gateway.outside_only=true with gateway.agent={self.gateway.agent!r}: the in-process agent plays the "
                "prompts the run leases from its data set, and an outside-only run leases none. Leave gateway.agent "
                "empty (run your agent outside: demos/outside_agent.py), or set gateway.outside_only=false")
        if self.train.eval_every:
            raise ValueError(
                f"gateway.outside_only=true with train.eval_every={self.train.eval_every}: held-out evaluation plays "
                "the test split of the run's data set with the built-in loop, and an outside-only run loads no data "
                "set. Set train.eval_every=0 (train.eval_sets still run after training; or `relayrl eval` on "
                "RUN/final_model), or set gateway.outside_only=false")

    @model_validator(mode="after")
    def _check_lora(self) -> "RunConfig":
        """What LoRA (model.lora.rank > 0) does not run correctly, refused before any actor starts."""
        lora = self.model.lora
        if not lora.enabled:
            return self
        if self.model.dtype != "float32" and not self.cluster.use_gpus:
            raise ValueError(
                f"model.lora.rank={lora.rank} with model.dtype={self.model.dtype} on CPU (cluster.use_gpus=false): "
                "with an adapter, vLLM's CPU kernels and the learner disagree far more in 16-bit than without one "
                "(docs/lora.md), so the importance ratios and the weight-sync check would be off. Use "
                "model.dtype=float32 on CPU")
        if self.learner.sequence_parallel_size > 1:
            raise ValueError(
                f"model.lora.rank={lora.rank} with learner.sequence_parallel_size="
                f"{self.learner.sequence_parallel_size}: LoRA has not been run under sequence parallelism. Use "
                "learner.sequence_parallel_size=1, or model.lora.rank=0")
        return self

    def _check_sequence_parallel_algorithm(self, sp: int) -> None:
        """What sequence parallelism does not run correctly. (Whole-sequence quantities, GSPO's ratio and
        sequence-level off-policy masks, are summed over the SP group: learner.sequence_parallel
        .sequence_mean_over_group.)"""
        if self.learner.zero_stage == 3:
            raise ValueError(
                f"learner.zero_stage=3 with learner.sequence_parallel_size={sp}: in a one-step check on CPU "
                f"(gloo) ZeRO-3 under the Ulysses mpu matched one rank in loss, log-probs and weights but reported "
                f"half the gradient norm, so learner.max_grad_norm would clip at the wrong norm. Use "
                f"learner.zero_stage=2")

    @property
    def samples_per_step(self) -> int:
        return self.learner.prompts_per_step * self.rollout.samples_per_prompt


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """`learner.lr=1e-4` -> ("learner.lr", 0.0001). Values are parsed as YAML, so lists and bools work."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. learner.lr=1e-4")
        value = yaml.safe_load(raw)
        if isinstance(value, str):
            # YAML 1.1 reads `1e-4` as a string; users mean a number.
            try:
                value = float(value)
            except ValueError:
                pass
        parsed.append((key.strip(), value))
    return parsed


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            model = _model_at(RunConfig, [p for p in e["loc"][:-1] if isinstance(p, str)])
            allowed = sorted(model.model_fields) if model else []
            lines.append(f"unknown config key `{where}`; allowed keys here: {', '.join(allowed)}")
        else:
            lines.append(f"`{where}`: {e['msg']} (got {e.get('input')!r})")
    return "invalid run config:\n  " + "\n  ".join(lines)


def _model_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    parts = list(path)
    while parts:
        field = model.model_fields.get(parts.pop(0))
        ann = getattr(field, "annotation", None)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
            continue
        # A `type`-keyed union (weight_sync): pydantic's error path names the chosen member by its tag next.
        members = {getattr(m.model_fields.get("type"), "default", None): m for m in getattr(ann, "__args__", ())
                   if isinstance(m, type) and issubclass(m, BaseModel)}
        if not parts or parts[0] not in members:
            return None
        model = members[parts.pop(0)]
    return model


class ConfigError(ValueError):
    """A config that fails validation; the message names every bad key and what is allowed."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (or start from defaults), apply overrides, validate. Raises ConfigError before any actor starts."""
    tree: dict[str, Any] = {}
    if path:
        text = Path(path).read_text()
        tree = yaml.safe_load(text) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(tree).__name__}")
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
