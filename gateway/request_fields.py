"""What the session endpoint does with every field of an OpenAI chat completions or completions request: each one
is served, or refused with a 400 that names it, says why and what to send instead. Nothing is silently ignored.

The rule that decides: a field is served where the tokens the engine samples stay draws of the run's own policy
(the learner's importance ratio divides by exactly that distribution). A field that would reshape the distribution
(another temperature, penalties, a forced tool call, a JSON schema through constrained decoding) is refused, since
the learner would train on tokens its policy did not choose, with log-probs it cannot reproduce. `CHAT_FIELDS` and
`COMPLETION_FIELDS` are the tables docs/agents.md prints; `read_options` applies them to a request. Pure: no
engine, no server."""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.sessions import SessionError, finite

MAX_N = 16
"""Most choices one request may ask for (`n`): each is its own engine request."""
MAX_STOP = 4
"""Most stop strings one request may give, as OpenAI's API allows."""
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}
"""Most alternatives per token a reply may list (`top_logprobs`; the completions route's `logprobs`), as OpenAI's."""

_DISTRIBUTION = ("it would sample from another distribution than the run's policy, and the learner trains on these "
                 "tokens with the run's own sampling (its importance ratio needs it)")
SERVED = "served"

CHAT_FIELDS: dict[str, str] = {
    "messages": SERVED,
    "model": f"{SERVED}: any name is taken; replies name `gateway.model_name` (GET /v1/models lists it)",
    "tools": f"{SERVED}: rendered by the model's chat template; calls are read in the model's format (Hermes)",
    "tool_choice": f"{SERVED} for \"auto\" and \"none\"; \"required\", a named function or allowed_tools are refused: "
                   "forcing a call constrains decoding",
    "parallel_tool_calls": f"{SERVED} for true (every call the model writes is returned); false is refused: it "
                           "cannot be enforced without constraining decoding",
    "stream": f"{SERVED}: server-sent chat.completion.chunk events while the engine samples",
    "stream_options": f"{SERVED}: include_usage; include_obfuscation false (no obfuscation padding is sent)",
    "max_completion_tokens": f"{SERVED}: clamped to gateway.max_tokens and the engine's context (counted "
                             "`clamped_max_tokens`; the reply ends with finish_reason \"length\")",
    "max_tokens": f"{SERVED}: as max_completion_tokens, which wins when both are sent",
    "n": f"{SERVED}: n choices (up to {MAX_N}), each its own sample of the session's call tree",
    "stop": f"{SERVED}: up to {MAX_STOP} strings; a reply ends at the first, which it leaves out, as an end of turn "
            "ends it (the next call continues from the tokens sampled)",
    "seed": f"{SERVED}: the engine's sampling seed (choice i draws from seed + i)",
    "logprobs": f"{SERVED}: the engine's processed log-probs of the sampled tokens (the behavior log-probs trained on)",
    "top_logprobs": f"{SERVED}: up to {MAX_TOP_LOGPROBS['chat']} alternatives per token, with logprobs=true",
    "temperature": f"{SERVED} when it is the run's rollout.temperature; another value is refused: {_DISTRIBUTION}",
    "top_p": f"{SERVED} when it is the run's rollout.top_p; another value is refused: {_DISTRIBUTION}",
    "frequency_penalty": f"{SERVED} at 0; another value is refused: {_DISTRIBUTION}",
    "presence_penalty": f"{SERVED} at 0; another value is refused: {_DISTRIBUTION}",
    "logit_bias": f"{SERVED} when empty; a bias is refused: {_DISTRIBUTION}",
    "response_format": f"{SERVED} for {{\"type\": \"text\"}}; json_object and json_schema are refused: constrained "
                       "decoding samples tokens the policy did not choose",
    "metadata": f"{SERVED}: kept with the call in the session's record (RUN/gateway/episodes-worker-N.jsonl)",
    "user": f"{SERVED}: kept with the call in the session's record",
    "safety_identifier": f"{SERVED}: kept with the call in the session's record",
    "store": f"{SERVED} for true: every call is stored in the session's record; false is refused (training keeps "
             "every call)",
    "service_tier": f"{SERVED}: one tier; replies say \"default\"",
    "prompt_cache_key": f"{SERVED}: a cache hint; the engine reuses a session's prefill by itself, per weight version",
    "prompt_cache_retention": f"{SERVED}: a cache hint (see prompt_cache_key)",
    "prompt_cache_options": f"{SERVED}: a cache hint (see prompt_cache_key)",
    "functions": "refused: the deprecated function-calling fields; send `tools`",
    "function_call": "refused: the deprecated function-calling fields; send `tool_choice`",
    "audio": "refused: the endpoint serves text",
    "modalities": f"{SERVED} for [\"text\"]; other modalities are refused (the endpoint serves text)",
    "prediction": "refused: predicted outputs are not served",
    "reasoning_effort": "refused: the model's chat template decides how it thinks; pass its own switch in "
                        "chat_template_kwargs (e.g. {\"enable_thinking\": false})",
    "verbosity": "refused: the policy's own length is what is trained; bound it with max_completion_tokens",
    "web_search_options": "refused: the endpoint has no web search; give the model a search tool",
    "moderation": "refused: the endpoint runs no moderation model",
}
"""Every field of a chat completions request (`openai.types.chat.completion_create_params`), and what the endpoint
does with it. A field not listed is refused by name."""

COMPLETION_FIELDS: dict[str, str] = {
    "model": CHAT_FIELDS["model"],
    "prompt": f"{SERVED}: one prompt per call, a string or a list of token ids (a batch of prompts is refused)",
    "stream": f"{SERVED}: server-sent text_completion events while the engine samples",
    "stream_options": CHAT_FIELDS["stream_options"],
    "max_tokens": CHAT_FIELDS["max_completion_tokens"],
    "n": CHAT_FIELDS["n"],
    "best_of": f"{SERVED} when it is n (or absent); more is refused: keeping the likeliest of several draws is a "
               "selection the learner does not see",
    "stop": CHAT_FIELDS["stop"],
    "seed": CHAT_FIELDS["seed"],
    "logprobs": f"{SERVED}: up to {MAX_TOP_LOGPROBS['completions']}: the engine's processed log-probs of the sampled "
                "tokens and that many alternatives",
    "echo": f"{SERVED} when false; true is refused: prompt log-probs are not computed (prepend the prompt yourself)",
    "suffix": "refused: insertion (fill in the middle) is not served",
    "temperature": CHAT_FIELDS["temperature"],
    "top_p": CHAT_FIELDS["top_p"],
    "frequency_penalty": CHAT_FIELDS["frequency_penalty"],
    "presence_penalty": CHAT_FIELDS["presence_penalty"],
    "logit_bias": CHAT_FIELDS["logit_bias"],
    "user": CHAT_FIELDS["user"],
}
"""Every field of a (legacy) completions request (`openai.types.completion_create_params`), as CHAT_FIELDS."""

_NEUTRAL = "served at the value that changes nothing ({}); another is refused: "
VLLM_FIELDS: dict[str, str] = {
    "chat_template_kwargs": f"{SERVED} (chat): extra arguments of the model's chat template",
    "return_token_ids": f"{SERVED}: the prompt's and each choice's token ids in the reply",
    "return_tokens_as_token_ids": f"{SERVED}: log-prob entries name tokens as \"token_id:N\"",
    "include_stop_str_in_output": f"{SERVED}: the stop string the reply ended at is kept in its text",
    "request_id": f"{SERVED}: kept with the call in the session's record",
    "cache_salt": f"{SERVED}: a cache hint; the engine salts each session's prefill by weight version itself",
    "top_k": _NEUTRAL.format("-1 or 0") + _DISTRIBUTION,
    "min_p": _NEUTRAL.format("0") + _DISTRIBUTION,
    "repetition_penalty": _NEUTRAL.format("1") + _DISTRIBUTION,
    "length_penalty": _NEUTRAL.format("1") + "beam search is not served",
    "use_beam_search": _NEUTRAL.format("false") + "beam search is not served",
    "min_tokens": _NEUTRAL.format("0") + "it forbids the end of turn, " + _DISTRIBUTION,
    "ignore_eos": _NEUTRAL.format("false") + "it samples past the policy's own end of turn",
    "skip_special_tokens": _NEUTRAL.format("true") + "a reply's text leaves special tokens out, so the next "
                           "call's messages render as the engine saw them (return_token_ids gives every id)",
    "spaces_between_special_tokens": _NEUTRAL.format("true") + "special tokens are left out of the text",
    "add_generation_prompt": _NEUTRAL.format("true") + "each call samples a new assistant turn (the "
                             "completions route continues any text)",
    "continue_final_message": _NEUTRAL.format("false") + "each call samples a new assistant turn (the "
                              "completions route continues any text)",
    "echo": _NEUTRAL.format("false") + "prompt log-probs are not computed",
    "priority": _NEUTRAL.format("0") + "calls are scheduled in arrival order",
    "prompt_logprobs": _NEUTRAL.format("null") + "prompt log-probs are not computed",
    "guided_json": "refused: constrained decoding samples tokens the policy did not choose",
    "guided_regex": "refused: constrained decoding samples tokens the policy did not choose",
    "guided_choice": "refused: constrained decoding samples tokens the policy did not choose",
    "guided_grammar": "refused: constrained decoding samples tokens the policy did not choose",
    "structured_outputs": "refused: constrained decoding samples tokens the policy did not choose",
    "allowed_token_ids": "refused: masking tokens samples from another distribution than the run's policy",
    "bad_words": "refused: masking tokens samples from another distribution than the run's policy",
    "truncate_prompt_tokens": "refused: a session's prompts are kept whole (each extends the last call)",
}
"""vLLM's own request fields (sent through the SDK's `extra_body`), which agent clients written for vLLM send: on
both routes, except `chat_template_kwargs` (chat only). Any other field is refused by name."""

NEUTRAL_VALUES: dict[str, tuple] = {
    "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "length_penalty": (1,), "use_beam_search": (False,),
    "min_tokens": (0,), "ignore_eos": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "add_generation_prompt": (True,), "continue_final_message": (False,),
    "echo": (False,), "priority": (0,)}
"""The vLLM fields served only at these values (any other changes what is sampled or what a reply means)."""

RECORDED = ("metadata", "user", "safety_identifier", "request_id")
"""Fields kept with the call in the session's record."""


@dataclass(frozen=True)
class Sampling:
    """The run's sampling, which a request may restate but not change."""

    temperature: float
    top_p: float


@dataclass(frozen=True)
class CallOptions:
    """What a request asks of the engine beyond its prompt (see the tables above)."""

    max_tokens: int | None = None
    """As asked (None: the endpoint's bound); the server clamps it."""
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int | None = None
    """None: no log-probs in the reply; k: each sampled token's log-prob and its k likeliest alternatives."""
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    keep_stop: bool = False
    """include_stop_str_in_output: the stop string stays in the reply's text."""
    token_id_names: bool = False
    """return_tokens_as_token_ids: log-prob entries name tokens "token_id:N"."""
    recorded: tuple[tuple[str, Any], ...] = ()
    """The request's RECORDED fields, kept with the call."""


def refuse(name: str, value: Any, why: str, fix: str) -> SessionError:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return SessionError(400, f"{name}={text} is refused: {why}. {fix}", param=name)


def read_options(body: Mapping[str, Any], route: str, sampling: Sampling) -> CallOptions:
    """The request's options, or a SessionError (400) naming the first field refused. `route`: "chat" or
    "completions"."""
    table = fields(route)
    unknown = [k for k in body if k not in table]
    if unknown:
        raise SessionError(400, f"unknown field {unknown[0]!r} in a {route} request; this endpoint serves the OpenAI "
                           f"fields docs/agents.md lists: {', '.join(table)}", param=unknown[0])
    given = {k: v for k, v in body.items() if v is not None}  # an explicit null is the field left out
    _refuse_reshaping(given, sampling, route)
    _refuse_vllm(given, route)
    n = _int(given, "n", 1, MAX_N, 1)
    if route == "chat":
        _refuse_chat_only(given)
        asked = given.get("max_completion_tokens", given.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
        want_logprobs = _bool(given, "logprobs", False)
        top = _int(given, "top_logprobs", 0, MAX_TOP_LOGPROBS["chat"], 0)
        if "top_logprobs" in given and not want_logprobs:
            raise refuse("top_logprobs", given["top_logprobs"], "it needs logprobs=true", "Send logprobs=true too")
        top_logprobs = top if want_logprobs else None
    else:
        _refuse_completion_only(given, n)
        asked, name = given.get("max_tokens"), "max_tokens"
        top_logprobs = _int(given, "logprobs", 0, MAX_TOP_LOGPROBS["completions"], None)
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int) or asked < 1):
        raise refuse(name, asked, "it must be a positive integer", "Send a number of tokens, e.g. 256")
    seed = given.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise refuse("seed", seed, "it must be a non-negative integer", "Send e.g. seed=1234")
    stream_options = given.get("stream_options", {})
    if not isinstance(stream_options, Mapping):
        raise refuse("stream_options", stream_options, "it must be an object", 'Send {"include_usage": true}')
    for key, value in stream_options.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise refuse(f"stream_options.{key}", value, "it is not a stream option", "Send include_usage only")
        if key == "include_obfuscation" and value:
            raise refuse("stream_options.include_obfuscation", value, "no obfuscation padding is sent",
                         "Send false or leave it out")
    return CallOptions(max_tokens=asked, n=n, stop=_stop(given.get("stop")), seed=seed, top_logprobs=top_logprobs,
                       return_token_ids=_bool(given, "return_token_ids", False), stream=_bool(given, "stream", False),
                       keep_stop=_bool(given, "include_stop_str_in_output", False),
                       token_id_names=_bool(given, "return_tokens_as_token_ids", False),
                       include_usage=bool(stream_options.get("include_usage")),
                       recorded=tuple((k, given[k]) for k in RECORDED if k in given))


def fields(route: str) -> dict[str, str]:
    """Every field a request on `route` ("chat" or "completions") may carry, and what is done with it."""
    if route == "chat":
        return {**CHAT_FIELDS, **VLLM_FIELDS}
    return {**{k: v for k, v in VLLM_FIELDS.items() if k != "chat_template_kwargs"}, **COMPLETION_FIELDS}


def _refuse_vllm(given: Mapping[str, Any], route: str) -> None:
    for name, value in given.items():
        if name in NEUTRAL_VALUES and not (route == "completions" and name == "echo"):
            neutral = NEUTRAL_VALUES[name]
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
                why = VLLM_FIELDS[name].split("; another is refused: ", 1)[1]
                raise refuse(name, value, why, f"Send {json.dumps(neutral[0])} or leave it out")
        elif VLLM_FIELDS.get(name, "").startswith("refused") and value not in ([], {}, ""):
            raise refuse(name, value, VLLM_FIELDS[name].removeprefix("refused: "), "Leave it out")
    if given.get("prompt_logprobs") not in (None, 0):
        raise refuse("prompt_logprobs", given["prompt_logprobs"], "prompt log-probs are not computed", "Leave it out")


def _refuse_reshaping(given: Mapping[str, Any], sampling: Sampling, route: str) -> None:
    for name, run_value, setting in (("temperature", sampling.temperature, "rollout.temperature"),
                                     ("top_p", sampling.top_p, "rollout.top_p")):
        value = given.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):
            raise refuse(name, value, "it must be a number", f"Leave it out (the run samples at {run_value:g})")
        if abs(value - run_value) > 1e-6:
            raise refuse(name, value, f"the run samples at {setting}={run_value:g} and {_DISTRIBUTION}",
                         f"Leave it out, or send {run_value:g}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = given.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != 0:
            raise refuse(name, value, _DISTRIBUTION, "Leave it out, or send 0")
    if given.get("logit_bias"):
        raise refuse("logit_bias", given["logit_bias"], _DISTRIBUTION, "Leave it out")
    if route == "chat":
        fmt = given.get("response_format", {"type": "text"})
        if not isinstance(fmt, Mapping) or fmt.get("type") != "text":
            raise refuse("response_format", fmt, "constrained decoding samples tokens the policy did not choose, "
                         "which the learner would train on as its own", 'Ask for JSON in the prompt and parse the '
                         'reply, or send {"type": "text"}')
        choice = given.get("tool_choice", "auto")
        if choice not in ("auto", "none"):
            raise refuse("tool_choice", choice, "a forced tool call constrains decoding, so the learner would train "
                         "on a call its policy did not choose", 'Send "auto" (or leave it out) and ask for the tool '
                         "in the prompt")
        if given.get("parallel_tool_calls", True) is not True:
            raise refuse("parallel_tool_calls", given["parallel_tool_calls"], "a single call cannot be enforced "
                         "without constraining decoding", "Send true (or leave it out) and ask for one call in the "
                         "prompt")


def _refuse_chat_only(given: Mapping[str, Any]) -> None:
    for name, fix in (("functions", "Send `tools`"), ("function_call", "Send `tool_choice`"),
                      ("audio", "Leave it out"), ("prediction", "Leave it out"),
                      ("reasoning_effort", 'Pass the chat template\'s switch in chat_template_kwargs, e.g. '
                                           '{"enable_thinking": false}'),
                      ("verbosity", "Bound the reply with max_completion_tokens"),
                      ("web_search_options", "Give the model a search tool"), ("moderation", "Leave it out")):
        if name in given and given[name] not in ([], {}):
            raise refuse(name, given[name], CHAT_FIELDS[name].removeprefix("refused: "), fix)
    if given.get("modalities", ["text"]) != ["text"]:
        raise refuse("modalities", given["modalities"], "the endpoint serves text", 'Send ["text"] or leave it out')
    if given.get("store", True) is not True:
        raise refuse("store", given["store"], "every call of a session is kept for training", "Send true or leave "
                     "it out")
    args = given.get("chat_template_kwargs", {})
    if not isinstance(args, Mapping):
        raise refuse("chat_template_kwargs", args, "it must be an object", 'Send e.g. {"enable_thinking": false}')


def _refuse_completion_only(given: Mapping[str, Any], n: int) -> None:
    if given.get("best_of", n) != n:
        raise refuse("best_of", given["best_of"], COMPLETION_FIELDS["best_of"].split(": ", 1)[1],
                     f"Send best_of={n} (= n) or leave it out")
    if given.get("echo", False) is not False:
        raise refuse("echo", given["echo"], "prompt log-probs are not computed", "Prepend the prompt yourself")
    if given.get("suffix") not in (None, ""):
        raise refuse("suffix", given["suffix"], "insertion (fill in the middle) is not served", "Leave it out")


def _int(given: Mapping[str, Any], name: str, low: int, high: int, default: Any) -> Any:
    value = given.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise refuse(name, value, f"it must be an integer from {low} to {high}", f"Send {low} to {high}")
    return value


def _bool(given: Mapping[str, Any], name: str, default: bool) -> bool:
    value = given.get(name, default)
    if not isinstance(value, bool):
        raise refuse(name, value, "it must be true or false", "Send true or false")
    return value


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP
            or not all(isinstance(s, str) and s for s in stops)):
        raise refuse("stop", stop, f"it must be a non-empty string or a list of up to {MAX_STOP} of them",
                     'Send e.g. ["Observation:"]')
    return tuple(stops)
