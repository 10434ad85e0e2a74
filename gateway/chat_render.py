"""How the session endpoint turns chat messages into token ids with the model's own chat template: a whole
conversation (a new segment's prompt), or only the messages a client added since its last reply (the template's
delta, appended to the exact ids of earlier calls by gateway/episode.py). Also the canonical form of messages that
decides whether a call extends an earlier one. Pure: a Hugging Face tokenizer in, ids out."""

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rewards.tool_calls import MAX_JSON_DEPTH, json_depth

STUB_USER = "\u2063relayrl-stub-user\u2063"
STUB_REPLY = "\u2063relayrl-stub-reply\u2063"
"""Stand-ins for the conversation before the new messages when the delta is rendered: the template sees a user
turn and an assistant turn, then the new messages, so it opens and closes their turns as it would in the real
conversation, and the earlier turns it may re-render differently (dropped thinking, re-serialized tool calls)
never enter the delta."""


def openai_to_template(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI chat message as chat templates read it: content parts joined into text, None content as "", the
    `developer` role as `system`, and tool-call arguments (a JSON string in OpenAI's format) as the object
    templates serialize (as vLLM passes them); arguments that are not JSON stay text."""
    out = {k: v for k, v in message.items() if v is not None}
    if out.get("role") == "developer":  # OpenAI's newer name for system instructions; templates know only system
        out["role"] = "system"
    out["content"] = content_text(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        function["arguments"] = arguments_object(function.get("arguments"))
        calls.append({**call, "function": function})
    if calls:
        out["tool_calls"] = calls
    else:
        out.pop("tool_calls", None)
    return out


def arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as JSON text (OpenAI's format) read into the object they hold. Text that is not JSON
    stays text, and so does JSON nested deeper than MAX_JSON_DEPTH: a client's message is refused that depth
    before the decoder recurses, as the model's own calls are (gateway/hermes.py)."""
    if not isinstance(arguments, str) or json_depth(arguments) > MAX_JSON_DEPTH:
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def content_text(content: Any) -> str:
    """OpenAI content as text: a string as is, a list of parts as their `text` joined, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return str(content)


def canonical_message(message: Mapping[str, Any]) -> tuple:
    """What makes two messages the same turn for joining: role, content text (None == ""), name, reasoning, and
    the tool calls' names and arguments (JSON compared as objects, key order ignored); tool-call ids are left out
    (a client may echo them back rewritten)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = arguments_object(function.get("arguments"))
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    return (message.get("role"), content_text(message.get("content")), message.get("name") or "",
            reasoning, tuple(calls))


def canonical_key(value: Any) -> str:
    """A tool list or template arguments as one comparable string (key order ignored; None == empty)."""
    return json.dumps(value or None, sort_keys=True)


class ChatRenderer:
    """The chat template of one tokenizer. `turn_end` is the text that closes a turn (the tokenizer's EOS,
    `<|im_end|>` for Qwen), which the engine stops at and the template writes after each assistant turn."""

    def __init__(self, tokenizer: Any, turn_end: str | None = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the session endpoint renders chat with the model's chat template, and this tokenizer has none: "
                "set `chat_template` in the model folder's tokenizer_config.json")
        self.tokenizer = tokenizer
        self.turn_end = turn_end or tokenizer.eos_token
        self.turn_end_ids = self.encode(self.turn_end)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None, template_args: dict,
               generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [openai_to_template(m) for m in messages], tools=tools or None, tokenize=False,
            add_generation_prompt=generation_prompt, **template_args)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None,
                   template_args: dict) -> list[int]:
        """A whole conversation followed by the generation prompt: the prompt of a new segment (the template
        writes any BOS itself, so no special tokens are added)."""
        return self.encode(self.render(messages, tools, template_args, generation_prompt=True))

    def delta_ids(self, new_messages: Sequence[Mapping[str, Any]], tools: list[dict] | None,
                  template_args: dict) -> list[int] | None:
        """The tokens the template writes after an assistant turn's `turn_end` when `new_messages` follow it: the
        rest of that turn's close (Qwen's `\\n`), the new messages' turns and the generation prompt. None when the
        template is not prefix-stable there (the ids of the conversation up to the close, followed by these, would
        not be the ids of the whole text): the caller then starts a new segment."""
        stub = [{"role": "user", "content": STUB_USER}, {"role": "assistant", "content": STUB_REPLY}]
        text = self.render([*stub, *new_messages], tools, template_args, generation_prompt=True)
        reply_at = text.find(STUB_REPLY)
        close_at = text.find(self.turn_end, reply_at) if reply_at >= 0 else -1
        if close_at < 0:
            return None
        head = text[: close_at + len(self.turn_end)]
        delta = self.encode(text[len(head):])
        if self.encode(head) + delta != self.encode(text):
            return None
        return delta
