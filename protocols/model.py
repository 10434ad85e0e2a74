"""Which policy model a run trains: a Hugging Face folder, or the tiny built-in demo model.

`ModelConfig.path` empty means "build the demo model" (demos/arithmetic_model.py builds it once, warm-starts it on
the arithmetic task and caches it); any other value is a local Hugging Face folder loaded as is.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from protocols.lora import LoraConfig


class DemoModelConfig(BaseModel):
    """A Qwen2-architecture model small enough to train in minutes on 2 CPU cores, for the arithmetic task."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(128, ge=8, le=4096)
    """Width of the residual stream. 128 learns two-digit addition; must equal num_heads * head_dim."""

    num_layers: int = Field(2, ge=1, le=48)
    """Transformer blocks. 2 is enough for the demo; more layers learn slower per second on a CPU."""

    num_heads: int = Field(2, ge=1, le=64)
    """Query heads per layer. Must be a multiple of num_kv_heads."""

    num_kv_heads: int = Field(1, ge=1, le=64)
    """Key/value heads per layer (grouped-query attention, as in Qwen2). 1 keeps the KV cache smallest."""

    head_dim: int = Field(64, ge=32, le=256)
    """Channels per attention head. vLLM's CPU attention rejects 16; 32 or more is needed, 64 is tested."""

    intermediate_size: int = Field(256, ge=8, le=16384)
    """Hidden width of each MLP block (SwiGLU). 2x hidden_size gives about 0.3M parameters in total."""

    max_position_embeddings: int = Field(64, ge=16, le=4096)
    """Longest sequence (prompt + response) in tokens. The rollout engine's max_model_len cannot exceed it;
    an addition prompt of two 4-digit operands plus its answer fits in 17."""

    tied: bool = False
    """Share the input embedding and the output head (`tie_word_embeddings`), as Qwen2.5-0.5B does. Turn on
    to exercise weight sync of tied models; the demo learns either way."""

    warm_start_steps: int = Field(2500, ge=0, le=100_000)
    """Most supervised steps on training problems before RL (the target accuracy below usually stops it after
    450 to 1,500), so GRPO starts from a partly able model. 0 keeps the random model, which RL alone cannot
    lift (its reward is always 0). About 20 ms a step on 2 idle CPU cores."""

    warm_start_target_accuracy: float = Field(0.45, ge=0.0, le=1.0)
    """The warm start stops once greedy accuracy on 500 training-split problems it never trained on reaches
    this in two checks in a row (one every 10 steps), leaving room for RL to show a gain: held-out accuracy
    then starts at about 40-55%. 1.0 runs all `warm_start_steps`. A stop rule rather than a step count,
    because where the accuracy jumps varies with the seed (400 steps gave 6% to 30% across seeds)."""

    warm_start_lr: float = Field(1e-3, gt=0.0, le=1.0)
    """AdamW learning rate of the warm start. 3e-3 was seen not to learn at all at this size."""

    warm_start_batch: int = Field(64, ge=1, le=65_536)
    """Problems per warm-start step."""

    tool_share: float = Field(0.0, ge=0.0, le=1.0)
    """Share of warm-start problems written as a calculator call, its output (context, no loss) and the copied
    result; the rest are answered directly. 0 (the addition demo): the model never sees a tool. The tool demo
    (deploy/configs/demo_tools.yaml) uses 0.3, so the warm-started model calls the tool on some problems and RL
    has room to raise the call rate. Adds the tool tags (`tools.call_start` etc.) to the demo vocabulary."""

    warm_start_target_call_rate: float = Field(0.35, gt=0.0, le=1.0)
    """With tool_share > 0, the warm start stops (instead of at warm_start_target_accuracy) once, in two checks in
    a row (one every 100 steps, on 200 problems), its greedy rollouts call the tool on at most this share of the
    check problems and at least 90% of those calls end in the right answer. Early in training the model calls on almost every problem;
    the call rate then falls as it learns to guess the answer's first digit."""

    seed: int = Field(0, ge=0)
    """Seeds the random init and the warm-start batches; a different seed builds (and caches) another model."""


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = ""
    """Local Hugging Face folder of the policy (weights, config and tokenizer). Empty: build the demo model
    described by `demo` (cached under $RELAYRL_CACHE_DIR, default ~/.cache/relayrl/demo_models)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weight dtype in the rollout engine and the learner. Unset, float32 on CPU and bfloat16 with
    cluster.use_gpus (protocols/device_defaults.py); float32 on a GPU is allowed (exact, slower)."""

    demo: DemoModelConfig = Field(default_factory=DemoModelConfig)
    """Settings of the built-in demo model; ignored when `path` is set."""

    trust_remote_code: bool = False
    """Let transformers and vLLM run model code shipped inside the folder. Only for folders you trust."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Train a LoRA adapter instead of the full weights (`model.lora.rank=16`); the engines serve the adapter and
    each weight sync moves it alone (docs/lora.md). Off by default (rank 0)."""
