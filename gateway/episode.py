"""The token-exact record of one session (an episode): for each chat call, the prompt the endpoint builds for the
engine, and what the engine sampled. gateway/episode_samples.py turns the record into training samples.

A call whose messages extend an earlier call's messages plus that call's reply gets the earlier call's exact ids
(prompt + sampled) followed by the template's delta of the new messages (gateway/chat_render.py), so the model's
own tokens are never re-tokenized. Otherwise the call starts a new segment, and the reason is counted. Under
`history: render` every prompt is the template's rendering, and a call joins only where that rendering starts
with the earlier call's exact ids. A call with the same messages, tools and template arguments as an earlier one
is a retry: it gets that call's prompt, and its place in the tree."""

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.chat_render import ChatRenderer, canonical_key, canonical_message

HistoryMode = Literal["extend", "render"]
SPLIT_REASONS = ("edited_history", "tools_changed", "template_args_changed", "template_not_prefix",
                 "rendered_history")
"""Why a call started a new segment: its messages do not extend any earlier call's messages and reply; they do,
but the tool list or the template arguments changed (never joined: the system turn would differ); the template
is not prefix-stable after the reply (extend); the template's rendering is not the earlier ids (render)."""


@dataclass(frozen=True)
class ChatCall:
    """What a chat call asks for: OpenAI messages, tools and the chat template's extra arguments; or, for a
    /v1/completions call, the prompt's ids (no messages)."""

    messages: Sequence[Mapping[str, Any]]
    tools: list[dict] | None = None
    template_args: Mapping[str, Any] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] | None = None
    """A completions call's prompt as ids; None for a chat call."""


@dataclass(frozen=True)
class PromptPlan:
    """The prompt of one call and how it relates to earlier calls."""

    prompt_ids: list[int]
    parent: int | None
    """The call this one extends (its prompt + sampled ids start `prompt_ids`); None: a new segment."""
    split_reason: str | None = None
    """Why a new segment started (one of SPLIT_REASONS); None for the first call and for joins."""
    retry_of: int | None = None
    """The earlier call this one repeats (same messages, tools and template arguments); None otherwise."""


@dataclass
class CallRecord:
    """One call as the engine served it."""

    index: int
    call: ChatCall
    plan: PromptPlan
    reply: dict
    """The assistant message returned to the client (content and tool_calls): a later call extends this one
    when its messages hold it after this call's messages."""
    sampled_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    finish_reason: Literal["stop", "length"]
    delivered: bool = True
    """Whether the reply reached a client. One that reached none (the client left or timed out) trains only if a
    later call extends it; a retry of the same request is answered with it (gateway/calls.py)."""
    client: dict = field(default_factory=dict)
    """The request's own fields kept with the call (metadata, user, safety_identifier)."""

    @property
    def ids(self) -> list[int]:
        """Everything the engine saw and sampled in this call, in order."""
        return [*self.plan.prompt_ids, *self.sampled_ids]


@dataclass
class _Key:
    messages: tuple
    tools: str
    template_args: str


class Episode:
    """The calls of one session, in the order they were made. `plan` builds a call's prompt; `record` adds what
    the engine returned for it. Pure and single-threaded: the endpoint serializes calls of one session."""

    def __init__(self, renderer: ChatRenderer, history: HistoryMode = "extend") -> None:
        if history not in ("extend", "render"):
            raise ValueError(f"history={history!r}: choose `extend` (keep earlier turns as sampled) or `render` "
                             "(follow the chat template)")
        self.renderer = renderer
        self.history = history
        self.calls: list[CallRecord] = []
        self._keys: list[_Key] = []
        self.counts: Counter = Counter({"calls": 0, "retries": 0, **{f"splits_{r}": 0 for r in SPLIT_REASONS}})

    def _retry(self, key: "_Key") -> PromptPlan | None:
        for earlier, k in zip(reversed(self.calls), reversed(self._keys)):
            if k == key:
                return PromptPlan(earlier.plan.prompt_ids, earlier.plan.parent, retry_of=earlier.plan.retry_of
                                  if earlier.plan.retry_of is not None else earlier.index)
        return None

    def plan(self, call: ChatCall) -> PromptPlan:
        """The prompt for `call` (nothing is recorded until `record`)."""
        if call.prompt_ids is not None:
            return self._plan_completion(call)
        key = _key(call)
        retry = self._retry(key)
        if retry is not None:
            return retry
        prefix = [(c, k) for c, k in zip(self.calls, self._keys)
                  if len(key.messages) > len(k.messages)
                  and key.messages[: len(k.messages) + 1] == (*k.messages, canonical_message(c.reply))]
        same = [c for c, k in prefix if (k.tools, k.template_args) == (key.tools, key.template_args)]
        if not same or self.history == "render":
            whole = self.renderer.prompt_ids(call.messages, call.tools, dict(call.template_args))
        if not same:
            if not self.calls:
                return PromptPlan(whole, None)
            if not prefix:
                reason = "edited_history"
            elif any(k.tools != key.tools for _, k in prefix):
                reason = "tools_changed"
            else:
                reason = "template_args_changed"
            return PromptPlan(whole, None, reason)
        # the longest history this call extends; the latest of equals (a retry's continuation)
        parent = max(same, key=lambda c: (len(self._keys[c.index].messages), c.index))
        if self.history == "render":
            if whole[: len(parent.ids)] == parent.ids:
                return PromptPlan(whole, parent.index)
            return PromptPlan(whole, None, "rendered_history")
        new = call.messages[len(self._keys[parent.index].messages) + 1:]
        delta = self.renderer.delta_ids(new, call.tools, dict(call.template_args))
        if delta is None:
            whole = self.renderer.prompt_ids(call.messages, call.tools, dict(call.template_args))
            return PromptPlan(whole, None, "template_not_prefix")
        # a reply cut at max_tokens (or at a client's stop string) is closed as the template closes a turn
        end = self.renderer.turn_end_ids
        closed = parent.sampled_ids[-len(end):] == end
        return PromptPlan([*parent.ids, *([] if closed else end), *delta], parent.index)

    def _plan_completion(self, call: ChatCall) -> PromptPlan:
        """A completions call brings its own ids: it joins the call with the longest ids that start them."""
        retry = self._retry(_key(call))
        if retry is not None:
            return retry
        ids = list(call.prompt_ids)
        parents = [c for c in self.calls if len(c.ids) <= len(ids) and ids[: len(c.ids)] == c.ids]
        if parents:
            return PromptPlan(ids, max(parents, key=lambda c: (len(c.ids), c.index)).index)
        return PromptPlan(ids, None, "edited_history" if self.calls else None)

    def record(self, call: ChatCall, plan: PromptPlan, reply: dict, sampled_ids: list[int],
               behavior_logprobs: list[float], token_versions: list[int],
               finish_reason: Literal["stop", "length"], delivered: bool = True,
               client: dict | None = None) -> CallRecord:
        """Add a served call: `plan` as `plan(call)` returned it, and what the engine sampled on its prompt. One
        request's `n` choices are `n` records of the same plan: siblings, each a leaf until a later call extends it."""
        if not len(sampled_ids) == len(behavior_logprobs) == len(token_versions):
            raise ValueError(f"call {len(self.calls)}: {len(sampled_ids)} sampled ids, {len(behavior_logprobs)} "
                             f"log-probs and {len(token_versions)} versions; the engine gives one of each per token")
        record = CallRecord(len(self.calls), call, plan, dict(reply), list(sampled_ids), list(behavior_logprobs),
                            list(token_versions), finish_reason, delivered, dict(client or {}))
        self.calls.append(record)
        self._keys.append(_key(call))
        self.counts["calls"] += 1
        self.counts["retries"] += plan.retry_of is not None
        if plan.split_reason is not None:
            self.counts[f"splits_{plan.split_reason}"] += 1
        return record


def _key(call: ChatCall) -> _Key:
    if call.prompt_ids is not None:
        return _Key(("completion", *call.prompt_ids), "", "")
    return _Key(tuple(canonical_message(m) for m in call.messages), canonical_key(call.tools),
                canonical_key(dict(call.template_args)))
