"""The `algorithm:` section of the run config: which RL objective the learner optimizes, as named presets.

Only pydantic and the stdlib here. The maths lives in learner/ (entry point learner/objective.py); see
learner/ALGORITHMS.md for the formulas, the presets table and how to write your own objective.

Merge rule. `preset` fills every field the user did not give; a nested section (e.g. `policy_loss`) is deep-merged
key by key, so `{preset: dapo, policy_loss: {eps_high: 0.3}}` keeps DAPO's `eps_low`. A nested section that names a
different `type` than the preset's replaces the preset's section whole (the other type's fields would not apply).
"""

from copy import deepcopy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PresetName = Literal["reinforce", "rloo", "grpo", "dr_grpo", "dapo", "gspo", "cispo", "reinforce_pp", "ppo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

DEFAULT_PRESET: PresetName = "dapo"
"""The preset of an AlgorithmConfig (and so of a run) that names none. On the demo, dynamic sampling (train only on
groups with a signal) measured +18 points of held-out accuracy in 400 steps against +10 for grpo in 500."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


# ----------------------------------------------------------------------------------------------- advantages


class ReinforceAdvantage(_Strict):
    """A = R, the raw return (Williams 1992). No baseline: high variance, kept as the textbook reference."""

    type: Literal["reinforce"] = "reinforce"
    """Advantage estimator name."""


class GroupMeanAdvantage(_Strict):
    """A = R - mean(group rewards). `dr_grpo` is the same estimator under Dr.GRPO's name (Liu et al. 2025, eq. 3)."""

    type: Literal["group_mean", "dr_grpo"] = "group_mean"
    """Advantage estimator name; `dr_grpo` is an alias of `group_mean`."""


class RLOOAdvantage(_Strict):
    """A_i = R_i - mean of the other G-1 rewards of the group (Ahmadian et al. 2024). Needs group_size >= 2."""

    type: Literal["rloo"] = "rloo"
    """Advantage estimator name."""


class GRPOAdvantage(_Strict):
    """A = (R - mean) / (std + eps) over the group (Shao et al. 2024, DeepSeekMath, eq. in section 4.1.2)."""

    type: Literal["grpo"] = "grpo"
    """Advantage estimator name."""
    std: Literal["sample", "population"] = "sample"
    """Group std convention: `sample` divides the squared deviations by G-1 (torch.std default, as TRL and verl),
    `population` by G. Change it only to reproduce a codebase that uses the other one."""
    eps: float = Field(1e-6, ge=0.0, le=1.0)
    """Added to the std before dividing. All-equal groups get exactly 0 whatever its value."""


class ReinforcePPAdvantage(_Strict):
    """Per-token return-to-go, normalized over all loss tokens of the global batch (Hu 2025, REINFORCE++)."""

    type: Literal["reinforce_pp"] = "reinforce_pp"
    """Advantage estimator name."""
    group_baseline: bool = False
    """REINFORCE++-baseline: subtract the group mean reward first, then divide by the batch std (no re-centring,
    so all-equal groups keep exactly 0). Turn on for multi-sample-per-prompt reasoning RL."""
    eps: float = Field(1e-8, ge=0.0, le=1.0)
    """Added to the batch std before dividing."""


class GAEAdvantage(_Strict):
    """Generalized advantage estimation from a critic's per-token values (Schulman et al. 2016, eq. 16)."""

    type: Literal["gae"] = "gae"
    """Advantage estimator name."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount per token. 1.0 is usual for LLMs (the reward arrives once, at the end)."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda: 1.0 is the unbiased Monte-Carlo return minus V, lower trusts the critic more (less variance)."""
    whiten: bool = True
    """Normalize advantages to zero mean, unit std over the batch's loss tokens (standard in PPO-RLHF)."""


AdvantageConfig = Annotated[
    ReinforceAdvantage | GroupMeanAdvantage | RLOOAdvantage | GRPOAdvantage | ReinforcePPAdvantage | GAEAdvantage,
    Field(discriminator="type"),
]

# ---------------------------------------------------------------------------------------------- policy loss


class PPOClipLoss(_Strict):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with clip-higher (DAPO eq. 10) and dual-clip (Ye et al.
    2020, eq. 5). Token-level ratio against the old policy (proximal in decoupled mode, behavior in bypass)."""

    type: Literal["ppo_clip"] = "ppo_clip"
    """Policy loss name."""
    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip: the ratio is clipped at 1 - eps_low."""
    eps_high: float = Field(0.2, ge=0.0, le=10.0)
    """Upper clip: the ratio is clipped at 1 + eps_high. DAPO's clip-higher raises it (0.28) to keep exploring."""
    dual_clip_c: float | None = Field(None, gt=1.0, le=100.0)
    """Dual-clip bound for negative advantages: the loss of a token is at most -c*A. None disables. Typical 3."""


class GSPOLoss(_Strict):
    """GSPO: sequence ratio s = exp(mean token log-ratio), clipped per sequence (Zheng et al. 2025, eq. 5-7)."""

    type: Literal["gspo"] = "gspo"
    """Policy loss name."""
    eps_low: float = Field(3e-4, ge=0.0, lt=1.0)
    """Lower clip of the sequence ratio. Sequence ratios sit near 1, so its scale is ~1e-4, not 0.2."""
    eps_high: float = Field(4e-4, ge=0.0, le=10.0)
    """Upper clip of the sequence ratio."""


class CISPOLoss(_Strict):
    """CISPO: -sg(clip(ratio)) * A * log pi; the weight is clipped, never the gradient (MiniMax-M1 2025, eq. 4-5)."""

    type: Literal["cispo"] = "cispo"
    """Policy loss name."""
    eps_low: float = Field(1.0, ge=0.0, le=1.0)
    """Lower bound of the weight is 1 - eps_low; 1.0 means no lower bound, as MiniMax-M1."""
    eps_high: float = Field(1.0, ge=0.0, le=100.0)
    """Upper bound of the weight is 1 + eps_high. The paper does not state its value; 1.0 (cap 2) bounds the variance
    like TIS. Raise it if updates look too timid on stale data."""


class ReinforceLoss(_Strict):
    """Plain REINFORCE: loss = -A * log pi (Williams 1992). No ratio, no clip."""

    type: Literal["reinforce"] = "reinforce"
    """Policy loss name."""


PolicyLossConfig = Annotated[PPOClipLoss | GSPOLoss | CISPOLoss | ReinforceLoss, Field(discriminator="type")]

# ------------------------------------------------------------------------------------ off-policy, KL, shaping


class OffPolicyConfig(_Strict):
    """Correction for asynchronous data: the behavior policy mu (vLLM, possibly several versions old) is not the
    learner's policy. See learner/off_policy.py."""

    mode: Literal["decoupled", "bypass"] = "decoupled"
    """`decoupled` (AReaL, Fu et al. 2025): the learner recomputes proximal log-probs, clips against them and weights
    each token by proximal/mu. Costs one extra forward pass per batch, or none when the learner takes one optimizer step
    per batch (its own pre-update forward pass gives them). `bypass`: mu is the old policy, no recompute;
    cheaper, but staleness and vLLM/learner numeric mismatch eat into the clip band."""
    tis_cap: float | None = Field(2.0, ge=1.0, le=1e6)
    """Truncated importance sampling: behavior weights are capped at this value (Yao et al. 2025). None: no cap.
    In `bypass` mode it caps the weight of the `reinforce` loss only (ratio losses already bound their ratio)."""
    mask_low: float | None = Field(None, ge=0.0)
    """Tokens (or sequences, see mask_level) whose behavior weight is below this are masked out. None: no bound."""
    mask_high: float | None = Field(None, ge=0.0)
    """Tokens (or sequences) whose behavior weight is above this are masked out. None: no bound."""
    mask_level: Literal["token", "sequence"] = "token"
    """`sequence` masks a whole sequence when its geometric-mean weight exp(mean log w) leaves [mask_low, mask_high]."""

    @model_validator(mode="after")
    def _bounds(self) -> "OffPolicyConfig":
        if self.mask_low is not None and self.mask_high is not None and self.mask_low >= self.mask_high:
            raise ValueError(
                f"algorithm.off_policy.mask_low={self.mask_low} must be below mask_high={self.mask_high}: "
                "tokens are kept when mask_low <= weight <= mask_high; swap them or unset one."
            )
        return self


class KLConfig(_Strict):
    """KL to a frozen reference policy. Estimators k1/k2/k3 from Schulman, "Approximating KL divergence" (2020)."""

    beta: float = Field(0.0, ge=0.0, le=100.0)
    """KL coefficient. 0 disables the KL and no reference model is loaded."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """k1 = log(pi/ref) (unbiased, can be negative), k2 = (log r)^2/2, k3 = r - 1 - log r with r = ref/pi (unbiased,
    always >= 0, low variance)."""
    placement: Literal["loss", "reward"] = "loss"
    """`loss`: beta * KL is added to the per-token loss (GRPO). `reward`: beta * KL is subtracted from the reward
    token by token before the advantages are computed (PPO-RLHF)."""


class OverlongConfig(_Strict):
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13): a linear penalty over the last buffer tokens."""

    enabled: bool = False
    """Add the length penalty to the reward."""
    buffer_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    """Penalty zone as a fraction of max_response_tokens (DAPO: 4096 of 20480 = 0.2). Ignored if buffer_tokens > 0."""
    buffer_tokens: int = Field(0, ge=0)
    """Penalty zone in tokens (L_cache); 0 uses buffer_fraction. Must be below max_response_tokens."""
    penalty_factor: float = Field(1.0, ge=0.0, le=100.0)
    """Penalty at the length limit (reward is lowered by up to this much)."""


class DistillationConfig(_Strict):
    """On-policy distillation from a teacher (teacher.* workers score every sampled token): each token's advantage
    mixes the teacher's per-token signal with the verifier's (learner/distillation.py, learner/ALGORITHMS.md)."""

    weight: float = Field(0.0, ge=0.0, le=1.0)
    """lambda in A_t = lambda * (log pi_teacher(y_t) - log mu(y_t)) + (1 - lambda) * A_reward_t, where mu is the
    policy that sampled y_t (the behavior log-probs) and A_reward the preset's advantage from the verifier's reward.
    0: pure RL (the teacher, if any, is only measured); 1: pure distillation (the reward is logged, not trained
    on); between: both. Needs teacher.num_workers > 0 when above 0. With top_k > 0 it weighs the top-k loss
    instead: per token, lambda * KL_topk(pi_teacher || pi) + (1 - lambda) * the preset's loss of A_reward."""

    top_k: int = Field(0, ge=0, le=1024)
    """0 (default): the teacher's signal is its log-prob of the one sampled token (the advantage above). k > 0: the
    teacher ships its k most likely tokens and their log-probs at every response position, and the learner adds
    the forward KL from the teacher's top-k (renormalized) to the student at each sampled token's position, a dense
    per-position loss with no sampling noise (learner/distillation.py topk_forward_kl). Choose k to cover most of
    the teacher's mass (`teacher/topk_mass`): 8 to 64 on a real vocabulary; each token then travels with k ids and
    k log-probs. At most the vocabulary size; not with learner.sequence_parallel_size > 1."""


# ------------------------------------------------------------------------------------------------- presets

_PAPERS = {
    "reinforce": "Williams 1992, Simple statistical gradient-following algorithms (REINFORCE)",
    "rloo": "Ahmadian et al. 2024, Back to Basics: Revisiting REINFORCE Style Optimization (arXiv 2402.14740)",
    "grpo": "Shao et al. 2024, DeepSeekMath (arXiv 2402.03300), GRPO objective eq. 3",
    "dr_grpo": "Liu et al. 2025, Understanding R1-Zero-Like Training: A Critical Perspective (arXiv 2503.20783)",
    "dapo": "Yu et al. 2025, DAPO (arXiv 2503.14476), eq. 8",
    "gspo": "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv 2507.18071), eq. 5-7",
    "cispo": "MiniMax 2025, MiniMax-M1 (arXiv 2506.13585), CISPO eq. 4-5",
    "reinforce_pp": "Hu 2025, REINFORCE++ (arXiv 2501.03262)",
    "ppo": "Schulman et al. 2017 PPO (arXiv 1707.06347) with GAE (arXiv 1506.02438), as Ouyang et al. 2022",
}

_NO_KL: dict[str, Any] = {"beta": 0.0, "estimator": "k3", "placement": "loss"}
_OFF = {"enabled": False, "buffer_fraction": 0.2, "buffer_tokens": 0, "penalty_factor": 1.0}


def _preset(advantage: dict, policy_loss: dict, aggregation: str, kl: dict, **extra: Any) -> dict[str, Any]:
    return {
        "advantage": advantage,
        "policy_loss": policy_loss,
        "aggregation": aggregation,
        "kl": kl,
        "entropy_coef": 0.0,
        "overlong": dict(_OFF),
        "mask_truncated": False,
        "dynamic_sampling": False,
        **extra,
    }


_PPO = {"type": "ppo_clip", "eps_low": 0.2, "eps_high": 0.2, "dual_clip_c": None}

PRESETS: dict[str, dict[str, Any]] = {
    "reinforce": _preset({"type": "reinforce"}, {"type": "reinforce"}, "seq_mean_token_sum_norm", _NO_KL),
    "rloo": _preset(
        {"type": "rloo"}, {"type": "reinforce"}, "seq_mean_token_sum_norm",
        {"beta": 0.05, "estimator": "k1", "placement": "reward"},
    ),
    "grpo": _preset(
        {"type": "grpo", "std": "sample", "eps": 1e-6}, _PPO, "seq_mean_token_mean",
        {"beta": 0.04, "estimator": "k3", "placement": "loss"},
    ),
    "dr_grpo": _preset({"type": "group_mean"}, _PPO, "seq_mean_token_sum_norm", _NO_KL),
    "dapo": _preset(
        {"type": "grpo", "std": "sample", "eps": 1e-6},
        {"type": "ppo_clip", "eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": None},
        "token_mean", _NO_KL,
        overlong={"enabled": True, "buffer_fraction": 0.2, "buffer_tokens": 0, "penalty_factor": 1.0},
        dynamic_sampling=True,
    ),
    "gspo": _preset(
        {"type": "grpo", "std": "sample", "eps": 1e-6}, {"type": "gspo", "eps_low": 3e-4, "eps_high": 4e-4},
        "seq_mean_token_mean", _NO_KL,
    ),
    "cispo": _preset(
        {"type": "grpo", "std": "sample", "eps": 1e-6}, {"type": "cispo", "eps_low": 1.0, "eps_high": 1.0},
        "token_mean", _NO_KL,
    ),
    "reinforce_pp": _preset(
        {"type": "reinforce_pp", "group_baseline": False, "eps": 1e-8}, _PPO, "token_mean",
        {"beta": 0.01, "estimator": "k1", "placement": "reward"},
    ),
    "ppo": _preset(
        {"type": "gae", "gamma": 1.0, "lam": 0.95, "whiten": True}, _PPO, "token_mean",
        {"beta": 0.02, "estimator": "k1", "placement": "reward"},
    ),
}
"""Every preset is a complete choice of advantage, policy loss, aggregation, KL and shaping (not off_policy: the
async correction is a property of the system, not of the paper, and keeps its own default for every preset)."""


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = deepcopy(base)
    for key, value in override.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            if "type" in value and value["type"] != old.get("type"):
                out[key] = deepcopy(value)  # a different estimator/loss: its own defaults, not the preset's fields
            else:
                out[key] = _deep_merge(old, value)
        else:
            out[key] = value
    return out


class AlgorithmConfig(_Strict):
    """The whole objective. `AlgorithmConfig(preset="dapo")` is DAPO; any field given explicitly overrides it."""

    preset: PresetName = DEFAULT_PRESET
    """Named set of choices from one paper (table in learner/ALGORITHMS.md); DEFAULT_PRESET (dapo) when not given,
    as for a run. Fields you set override it."""
    advantage: AdvantageConfig = Field(default_factory=GRPOAdvantage)
    """Advantage estimator, chosen by `type`: reinforce, group_mean (alias dr_grpo), rloo, grpo, reinforce_pp, gae."""
    policy_loss: PolicyLossConfig = Field(default_factory=PPOClipLoss)
    """Policy loss, chosen by `type`: ppo_clip (with clip-higher and dual-clip), gspo, cispo, reinforce."""
    off_policy: OffPolicyConfig = Field(default_factory=OffPolicyConfig)
    """Correction for stale (asynchronous) samples. Default: decoupled + TIS cap 2 (see ALGORITHMS.md)."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL penalty to the reference policy; beta=0 disables it and skips loading the reference model."""
    aggregation: Aggregation = "seq_mean_token_mean"
    """How token losses become one number: `token_mean` over the global batch (DAPO), `seq_mean_token_mean`
    (GRPO: mean per sequence, then over sequences; long answers weigh less per token), `seq_mean_token_sum_norm`
    (Dr.GRPO: token sum / max_response_tokens, then mean over sequences; no length bias)."""
    entropy_coef: float = Field(0.0, ge=0.0, le=1.0)
    """Entropy bonus coefficient (loss -= coef * entropy). Entropy is always logged; 0 adds no bonus."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """DAPO soft overlong punishment."""
    mask_truncated: bool = False
    """Drop samples cut at max_response_tokens from the loss (DAPO's overlong filtering); they still count in
    their group's baseline."""
    dynamic_sampling: bool = False
    """Skip groups whose rewards are all equal (no learning signal) and keep sampling until the batch is full
    (DAPO). The pipeline reads it; learner.objective.zero_variance_groups finds those groups."""
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    """The teacher's share of the advantage (on-policy distillation); weight 0 (default) trains on the reward
    alone."""

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        preset = data.get("preset", DEFAULT_PRESET)
        if preset not in PRESETS:
            return data  # the Literal on `preset` reports the bad name with the allowed ones
        user = {k: (v.model_dump() if isinstance(v, BaseModel) else v) for k, v in data.items()}
        return _deep_merge(PRESETS[preset], user)

    @property
    def paper(self) -> str:
        """Citation of the preset's paper."""
        return _PAPERS[self.preset]
