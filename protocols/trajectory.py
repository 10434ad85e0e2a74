"""Records that flow through the pipeline: prompt -> rollout worker -> reward worker -> replay queue -> learner.

Every record is a pydantic model so it can be sent between Ray actors and written to disk (checkpoints of the
queue and of in-flight samples use `model_dump_json`).

A response is an ordered list of segments (`Trajectory.segments`): model segments, whose tokens the engine
sampled (with behavior log-probs and policy versions), and tool segments, a tool's output tokenized once and
appended as context, or context segments, tokens a session endpoint inserted between two calls of an episode
(gateway/: the chat template's rendering of the messages the client added). They are stored flat, token by token, in the order the model read them, because that is what
the learner consumes; `tool_calls` and `context_spans` mark where each tool or context segment lies. The learner
trains on exactly the token ids the engine sampled: model tokens are never re-tokenized, tool and context tokens
carry no loss (`loss_mask`).
"""

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TOKEN_SCORERS: dict[str, str] = {"reference": "ref_logprobs", "teacher": "teacher_logprobs"}
"""The roles whose frozen models score every response token while a group streams to the queue, and the
Trajectory (and TrainingBatch) field each one fills. The rollout worker's router sends a group to one worker of
every such role beside its reward task (the controller's scoring stage, actors/scoring_stage.py)."""


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


FinishReason = Literal["stop", "length", "abort", "max_turns"]
"""`length`: the response-token budget ran out; `max_turns`: a multi-turn sample still called a tool on its last
allowed turn (tools.max_turns). Both count as truncated."""

ToolError = Literal["", "unknown_tool", "exception", "timeout"]


class ToolCall(BaseModel):
    """One tool call of a multi-turn sample, and the tool segment its output became."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """The tool the model called (`python`, `calculator`, or a user tool's configured name)."""
    arguments: str
    """The call's body as the model wrote it (the text between the call tags)."""
    output: str
    """The tool's output text as appended (after truncation), or the error text when the call failed."""
    error: ToolError = ""
    """Why the call failed; empty when the tool returned normally. The error text is still the tool's output."""
    seconds: float = Field(0.0, ge=0)
    """Wall time the tool ran (its time in the pool, not the time it waited for a slot)."""
    output_truncated: bool = False
    """The output was longer than tools.max_output_tokens and was cut there."""
    output_start: int = Field(ge=0)
    """Index in `response_token_ids` of the tool segment's first token."""
    output_tokens: int = Field(ge=0)
    """Tokens in the tool segment (the rendered output template)."""
    text_end: int = Field(0, ge=0)
    """Characters of `response_text` up to the end of the tool segment: the model's final answer follows it."""


class ContextSpan(BaseModel):
    """Tokens of a response that the engine read but did not sample in this sample: what a session endpoint
    inserted between two calls of an episode (the template's rendering of the client's new messages, a turn close
    after a reply cut at max_tokens). Like a tool segment: behavior log-prob 0.0, version -1, no loss."""

    model_config = ConfigDict(extra="forbid")

    start: int = Field(ge=0)
    """Index in `response_token_ids` of the span's first token."""
    tokens: int = Field(ge=1)
    """Tokens in the span."""


@dataclass(frozen=True)
class Segment:
    """A view of one run of tokens of a response: `model` tokens carry behavior log-probs and versions."""

    kind: Literal["model", "tool", "context"]
    token_ids: list[int]
    behavior_logprobs: list[float] | None
    token_versions: list[int] | None


_OPTIONAL_ON_THE_WIRE = ("tool_calls", "context_spans", "environment_reward", "teacher_topk_ids",
                         "teacher_topk_logprobs")
"""Trajectory fields left out of a record's pickle when None, so records without them keep their bytes."""


@dataclass(frozen=True)
class TokenScores:
    """What a teacher worker returns for one group when algorithm.distillation.top_k = k > 0: its log-prob of every
    response token (as a list of rows, the form every token scorer returns otherwise) and, at every response
    position, its k most likely ids and their log-probs. One entry per trajectory, in order."""

    logprobs: list[list[float]]
    """(T,) per trajectory: log pi(token) of each response token."""
    topk_ids: list[list[list[int]]]
    """(T, k) per trajectory: the k most likely token ids at each position, most likely first."""
    topk_logprobs: list[list[list[float]]]
    """(T, k) per trajectory: their log-probs."""


class Trajectory(BaseModel):
    """One sampled response with everything the learner needs to train on it off-policy."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    """Samples of one prompt share a group id; group baselines are computed within it."""
    sample_index: int = Field(ge=0)
    prompt: Prompt
    response_token_ids: list[int]
    """Every response token in order: sampled tokens (EOS included when the model stopped by itself) and, in a
    multi-turn sample, the tool segments between them."""
    behavior_logprobs: list[float]
    """log mu(token) from vLLM at sampling time, one per response token; 0.0 on tool tokens."""
    token_versions: list[int]
    """Policy version of the weights that sampled each response token (partial rollouts mix versions); -1 on
    tool tokens."""
    finish_reason: FinishReason
    """`length` means truncated at max_response_tokens; `max_turns` at tools.max_turns."""
    response_text: str = ""
    """The whole response as text, tool segments included; `final_text` is the model's last segment."""
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda calls: calls is None)
    """The tool calls in order, each with where its output segment lies; None for a single-turn response (so it
    is what it was before multi-turn rollouts, on the wire and on disk)."""
    context_spans: list[ContextSpan] | None = Field(None, exclude_if=lambda spans: spans is None)
    """Context segments in order (an episode of a session endpoint, gateway/episode_samples.py); None elsewhere,
    so other records are what they were, on the wire and on disk."""
    malformed_call: bool = Field(False, exclude_if=lambda malformed: not malformed)
    """The last turn tried a tool call that did not parse (the agent loop's verdict, read by the tools/* metrics):
    the sample ended there as a plain response (finish reason `stop`)."""
    environment_reward: float | None = Field(None, exclude_if=lambda reward: reward is None)
    """The reward of the sample's environment episode (tools.environment; 0 when it gave none that is a number),
    which the reward worker puts in `reward` in place of the verifier's; None without an environment (so other
    records are what they were, on the wire and on disk)."""
    reward: float = 0.0
    result: VerifierResult | None = None
    """Set by the reward worker; None until scored."""
    worker_id: int = 0
    """Rollout worker that generated it."""
    ref_logprobs: list[float] | None = None
    """log pi_ref(token) of the frozen reference policy, one per response token, at the sampling temperature;
    added by a reference worker while the group streams toward the queue (reference.num_workers > 0). None
    when no reference worker group runs (the learner then scores the reference itself, if the KL needs it)."""
    teacher_logprobs: list[float] | None = None
    """log pi_teacher(token) of the frozen teacher model, one per response token, at the sampling temperature;
    added by a teacher worker while the group streams toward the queue (teacher.num_workers > 0). The
    distillation advantage (learner/distillation.py) reads it on the tokens the engine sampled."""
    teacher_topk_ids: list[list[int]] | None = Field(None, exclude_if=lambda ids: ids is None)
    """(T, k): the teacher's k most likely token ids at each response position, most likely first; added by a
    teacher worker beside `teacher_logprobs` when algorithm.distillation.top_k = k > 0. None otherwise (so other
    records are what they were, on the wire and on disk)."""
    teacher_topk_logprobs: list[list[float]] | None = Field(None, exclude_if=lambda lps: lps is None)
    """(T, k): log pi_teacher of those ids at the sampling temperature, unnormalized over the k (their exp sums to
    the teacher's mass in its top k). The top-k distillation loss (learner/distillation.py) reads them."""

    def __getstate__(self) -> dict[Any, Any]:
        # A single-turn record pickles (Ray's wire format) to the bytes it had before tool calls existed.
        state = super().__getstate__()
        unset = {name for name in _OPTIONAL_ON_THE_WIRE if getattr(self, name) is None}
        if unset:
            state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k not in unset}
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        for name in _OPTIONAL_ON_THE_WIRE:
            state["__dict__"].setdefault(name, None)
        super().__setstate__(state)

    def _context_runs(self) -> list[tuple[int, int, str]]:
        """(start, tokens, kind) of every tool and context segment, in order."""
        runs = [(c.output_start, c.output_tokens, "tool") for c in self.tool_calls or []]
        runs += [(s.start, s.tokens, "context") for s in self.context_spans or []]
        return sorted(runs)

    @property
    def loss_mask(self) -> list[bool]:
        """One flag per response token: True where the engine sampled the token (those train; tokens that are
        context only, such as a tool's output, do not). A single-turn response is all sampled tokens."""
        mask = [True] * len(self.response_token_ids)
        for start, tokens, _ in self._context_runs():
            mask[start: start + tokens] = [False] * tokens
        return mask

    @property
    def segments(self) -> list[Segment]:
        """The response as ordered model, tool and context segments (empty model segments are left out)."""
        out, start = [], 0
        ids, lps, versions = self.response_token_ids, self.behavior_logprobs, self.token_versions
        for begin, tokens, kind in self._context_runs():
            if begin > start:
                out.append(Segment("model", ids[start:begin], lps[start:begin], versions[start:begin]))
            out.append(Segment(kind, ids[begin:begin + tokens], None, None))
            start = begin + tokens
        if start < len(ids):
            out.append(Segment("model", ids[start:], lps[start:], versions[start:]))
        return out

    @property
    def final_text(self) -> str:
        """The text after the last tool segment: the model's final answer, which the verifier reads."""
        return self.response_text[self.tool_calls[-1].text_end:] if self.tool_calls else self.response_text

    @property
    def truncated(self) -> bool:
        """The sample ran out of its token budget or its turns."""
        return self.finish_reason in ("length", "max_turns")

    @property
    def num_turns(self) -> int:
        """Model turns: one more than the tool calls."""
        return 1 + len(self.tool_calls or [])

    @property
    def version_span(self) -> tuple[int, int]:
        """(oldest, newest) policy version that sampled a token, (-1, -1) for none; one walk of the tokens, for
        readers that need both (GroupHeader.of, the driver's staleness metrics)."""
        # the tool segments (tool_calls) say which tokens the engine sampled; the -1 on tool tokens is only a fill
        sampled = [v for v, model in zip(self.token_versions, self.loss_mask) if model]
        return (min(sampled), max(sampled)) if sampled else (-1, -1)

    @property
    def min_version(self) -> int:
        """Oldest policy version that produced a token (tool tokens have none): staleness is measured from it."""
        return self.version_span[0]

    @property
    def max_version(self) -> int:
        return self.version_span[1]


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

    def with_ref_logprobs(self, ref_logprobs: list[list[float]]) -> "TrajectoryGroup":
        """A copy whose trajectories carry `ref_logprobs`, as a reference worker computed them."""
        return self.with_token_scores("reference", ref_logprobs)

    def with_token_scores(self, role: str, rows: "list[list[float]] | TokenScores") -> "TrajectoryGroup":
        """A copy whose trajectories carry the per-token log-probs a frozen model of `role` (TOKEN_SCORERS)
        computed: one list per trajectory, in order, one value per response token; or a teacher's TokenScores,
        which add its top-k ids and log-probs at every position."""
        name = TOKEN_SCORERS[role]
        scores = rows if isinstance(rows, TokenScores) else None
        rows = scores.logprobs if scores is not None else rows
        lengths = [len(t.response_token_ids) for t in self.trajectories]
        if len(rows) != len(self.trajectories) or any(len(r) != n for r, n in zip(rows, lengths)):
            raise ValueError(
                f"group {self.group_id}: {role} log-probs of shape {[len(r) for r in rows]} do not match "
                f"its responses of {lengths} tokens")
        updates = [{name: list(r)} for r in rows]
        if scores is not None:
            for kind, table in (("ids", scores.topk_ids), ("log-probs", scores.topk_logprobs)):
                if len(table) != len(lengths) or any(len(t) != n for t, n in zip(table, lengths)):
                    raise ValueError(f"group {self.group_id}: {role} top-k {kind} for {[len(t) for t in table]} "
                                     f"positions do not match its responses of {lengths} tokens")
            for update, ids, lps in zip(updates, scores.topk_ids, scores.topk_logprobs):
                update.update(teacher_topk_ids=ids, teacher_topk_logprobs=lps)
        return self.model_copy(update={"trajectories": [
            t.model_copy(update=u) for t, u in zip(self.trajectories, updates)]})
