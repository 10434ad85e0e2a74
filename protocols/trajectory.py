"""Records that flow through the pipeline: prompt -> rollout worker -> reward worker -> replay queue -> learner.

Every record is a pydantic model so it can be sent between Ray actors and written to disk (checkpoints of the
queue and of in-flight samples use `model_dump_json`).
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Prompt(BaseModel):
    """One task instance, tokenized once by the data loader."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: str
    """Stable id: `<dataset>/<split>/<row>`, used to resume the data cursor and to debug."""
    prompt_token_ids: list[int]
    """Token ids fed to the policy, chat template already applied."""
    prompt_text: str = ""
    """The same prompt as text, for logs and verifiers that want it."""
    answer: str = ""
    """Gold answer the verifier compares against (a number, a LaTeX expression, ...)."""
    tests: list[dict[str, Any]] = Field(default_factory=list)
    """Test cases for code verifiers; empty for answer-matching tasks."""
    verifier: str = ""
    """Name of the registered verifier to use; empty means the run config's default."""
    metadata: dict[str, Any] = Field(default_factory=dict)


class VerifierResult(BaseModel):
    """What a verifier returns for one response."""

    model_config = ConfigDict(extra="forbid")

    reward: float
    """Scalar reward after shaping (the learner uses this)."""
    correct: bool = False
    """True when the task reward says the answer is right (accuracy metrics use this, not `reward`)."""
    info: dict[str, Any] = Field(default_factory=dict)
    """Verifier details: extracted answer, tests passed, reward components."""
    error: str = ""
    """Error kind when verification failed (`exception`, `timeout`, ...); empty on success."""


FinishReason = Literal["stop", "length", "abort"]


class Trajectory(BaseModel):
    """One sampled response with everything the learner needs to train on it off-policy."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    """Samples of one prompt share a group id; group baselines are computed within it."""
    sample_index: int = Field(ge=0)
    prompt: Prompt
    response_token_ids: list[int]
    """Sampled tokens, EOS included when the model stopped by itself."""
    behavior_logprobs: list[float]
    """log mu(token) from vLLM at sampling time, one per response token."""
    token_versions: list[int]
    """Policy version of the weights that sampled each response token (partial rollouts mix versions)."""
    finish_reason: FinishReason
    """`length` means truncated at max_response_tokens."""
    response_text: str = ""
    reward: float = 0.0
    result: VerifierResult | None = None
    """Set by the reward worker; None until scored."""
    worker_id: int = 0
    """Rollout worker that generated it."""
    values: list[float] | None = None
    """V(state before each response token) from the critic, one per response token; None without a critic.
    Set by a critic worker while the group streams toward the replay queue; GAE and the clipped value loss's
    old values read it."""
    critic_version: int | None = None
    """Critic updates the values were computed after (0: the initial critic). The replay queue drops a group
    whose values are more than train.max_staleness critic versions behind, as it does for policy versions."""
    ref_logprobs: list[float] | None = None
    """log pi_ref(token) of the frozen reference policy, one per response token, at the sampling temperature;
    added by a reference worker while the group streams toward the queue (reference.num_workers > 0). None
    when no reference worker group runs (the learner then scores the reference itself, if the KL needs it)."""

    @property
    def loss_mask(self) -> list[bool]:
        """One flag per response token: True where the engine sampled the token (those train; tokens that are
        context only, such as a tool's output, do not). A single-turn response is all sampled tokens."""
        return [True] * len(self.response_token_ids)

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced a token: staleness is measured from it."""
        return min(self.token_versions) if self.token_versions else -1

    @property
    def max_version(self) -> int:
        return max(self.token_versions) if self.token_versions else -1


class TrajectoryGroup(BaseModel):
    """All G samples of one prompt. The queue keeps groups whole so group baselines stay valid."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    trajectories: list[Trajectory]

    @property
    def min_version(self) -> int:
        return min(t.min_version for t in self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def critic_version(self) -> int | None:
        """Oldest critic version among the samples' values; None when any sample has none."""
        versions = [t.critic_version for t in self.trajectories]
        return None if any(v is None for v in versions) else min(versions)

    def with_ref_logprobs(self, ref_logprobs: list[list[float]]) -> "TrajectoryGroup":
        """A copy whose trajectories carry `ref_logprobs` (one list per trajectory, in order, one value per
        response token), as a reference worker computed them."""
        if len(ref_logprobs) != len(self.trajectories) or any(
                len(r) != len(t.response_token_ids) for r, t in zip(ref_logprobs, self.trajectories)):
            raise ValueError(
                f"group {self.group_id}: reference log-probs of shape {[len(r) for r in ref_logprobs]} do not match "
                f"its responses of {[len(t.response_token_ids) for t in self.trajectories]} tokens")
        return self.model_copy(update={"trajectories": [
            t.model_copy(update={"ref_logprobs": list(r)}) for t, r in zip(self.trajectories, ref_logprobs)]})


class WeightVersion(BaseModel):
    """Announces new learner weights. The tensors travel beside it (Ray object store or NCCL), not inside."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    """Policy version: 0 is the initial model; the learner increments it once per optimizer step."""
    num_tensors: int = Field(0, ge=0)
    num_bytes: int = Field(0, ge=0)
