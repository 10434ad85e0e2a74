"""The session endpoint's replies in OpenAI's shapes: chat.completion and text_completion bodies, their streamed
chunks, log-probs in each route's format, and the part of a reply's text a stream may send so far. Pure: the
engine's ids and log-probs in, JSON-ready dicts out (gateway/calls.py sends them)."""

import json
from dataclasses import dataclass
from typing import Any

from gateway.hermes import CALL_START


@dataclass
class Choice:
    """One choice of a reply: its message (chat) or text (completions), as recorded in the episode."""

    message: dict
    finish_reason: str
    sampled_ids: list[int]
    behavior_logprobs: list[float]
    top_logprobs: list[dict[int, tuple[float, int]]] | None


def cut_at_stop(text: str, stops: tuple[str, ...], keep: bool = False) -> str:
    """`text` up to the first of the stop strings (left out, as OpenAI's API does, or `keep`: with it); all of it
    if none occurs."""
    ends = sorted((at, at + len(s)) for s in stops if (at := text.find(s)) >= 0)
    return text[: ends[0][keep]] if ends else text


def streamable(text: str, tools_on: bool, stops: tuple[str, ...] = ()) -> str:
    """The part of a reply's text so far that a stream may send: not a trailing partial character (decoded as
    U+FFFD), not from a stop string on nor a tail that may begin one, and with tools not from a `<tool_call>` on,
    nor a tail that may begin one, since the final parse (gateway/hermes.py) takes calls out of the content."""
    text = cut_at_stop(text.rstrip("\ufffd"), stops)
    held = [*stops, CALL_START] if tools_on else list(stops)
    if tools_on and CALL_START in text:
        text = text[: text.find(CALL_START)]
    keep = len(text)
    for marker in held:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                keep = min(keep, len(text) - k)
                break
    return text[:keep]


def chat_logprobs(choice: Choice, decode, top: int) -> dict:
    """OpenAI's chat `logprobs`: each sampled token (tool-call and stop-string tokens included: these are the
    behavior log-probs the learner trains with) and its `top` likeliest alternatives."""
    def entry(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for k, (token_id, logprob) in enumerate(zip(choice.sampled_ids, choice.behavior_logprobs)):
        item = entry(token_id, logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in _ranked(choice, k, top)]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(choice: Choice, decode, top: int) -> dict:
    """The completions route's `logprobs`: tokens, their log-probs, the `top` alternatives and text offsets."""
    tokens = [decode(t) for t in choice.sampled_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {"tokens": tokens, "token_logprobs": list(choice.behavior_logprobs),
            "top_logprobs": [{decode(t): lp for t, lp in _ranked(choice, k, top)} for k in range(len(tokens))],
            "text_offset": offsets}


def _ranked(choice: Choice, position: int, top: int) -> list[tuple[int, float]]:
    if not top or choice.top_logprobs is None or position >= len(choice.top_logprobs):
        return []
    ranked = sorted(choice.top_logprobs[position].items(), key=lambda item: item[1][1])
    return [(token_id, logprob) for token_id, (logprob, _) in ranked[:top]]


def usage(prompt_tokens: int, choices: list[Choice]) -> dict:
    completion = sum(len(c.sampled_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class Chunks:
    """One streamed reply's events: chat.completion.chunk (chat) or text_completion (completions)."""

    def __init__(self, reply_id: str, created: int, model: str, chat: bool) -> None:
        self.chat = chat
        self.head = {"id": reply_id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}

    def __call__(self, index: int, delta: dict, finish_reason: str | None = None, logprobs: Any = None) -> str:
        if self.chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": delta.get("content", ""), "finish_reason": finish_reason,
                      "logprobs": logprobs}
        return f"data: {json.dumps({**self.head, 'choices': [choice]})}\n\n"

    def usage(self, counts: dict) -> str:
        return f"data: {json.dumps({**self.head, 'choices': [], 'usage': counts})}\n\n"


def error_event(status: int, message: str) -> str:
    """An error after the stream began (its status was already sent): the SDK raises it as an APIError."""
    return f"data: {json.dumps({'error': {'message': message, 'type': 'session_error', 'code': status}})}\n\n"
