"""A session's calls through the engine: each request runs as an `Attempt`, apart from the HTTP request that
asked, and is recorded in the session's episode when the engine ends it, whether or not its client stayed. The
same request sent again (an SDK's retry after a timeout, or sent twice at once) is answered with that attempt's
reply, so it is sampled and trained once; another call while one runs is refused 409. The routes are
gateway/server.py's; the request's fields are read by gateway/request_fields.py and the reply is shaped by
gateway/replies.py."""

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from gateway.engine_bridge import CallAborted, CallInbox, CallResult
from gateway.episode import CallRecord, ChatCall
from gateway.hermes import parse_hermes
from gateway.replies import (Choice, Chunks, chat_logprobs, completion_logprobs, cut_at_stop, error_event,
                             streamable, usage)
from gateway.request_fields import CallOptions, Sampling, read_options
from gateway.sessions import Session, SessionBook, SessionError


@dataclass(frozen=True)
class ServeSettings:
    model_name: str
    max_tokens: int
    """Most new tokens per call (gateway.max_tokens or rollout.max_response_tokens)."""
    max_model_len: int
    """The engine's context: prompt + new tokens never exceed it."""
    max_calls_in_flight: int
    retry_after_s: int
    tool_parser: str = "hermes"
    max_request_bytes: int = 16 * 2**20
    """gateway.max_request_bytes: a longer body is answered 413 before it is read whole."""
    sampling: Sampling = Sampling(temperature=1.0, top_p=1.0)
    """The run's rollout.temperature and rollout.top_p: a request may restate them, not change them."""



@dataclass
class Attempt:
    """One request's calls in the engine (`n` of them), apart from the HTTP request that asked: `task` records
    them in the episode when the engine ends them, whether or not the client stayed, and returns the choices."""

    signature: str
    """The request as sent (its stream fields aside): the same request again is this attempt's retry."""
    number: int
    """Its serial on this endpoint (reply ids and tool-call ids)."""
    prompt_tokens: int
    task: asyncio.Task | None = None
    records: list[CallRecord] = field(default_factory=list)
    listeners: list[asyncio.Queue] = field(default_factory=list)
    """Streams hearing (choice, ids so far) after each engine step."""
    delivered: bool = False

    def deliver(self) -> None:
        """Its reply reached a client: its calls train (gateway/episode_samples.py drops undelivered leaves)."""
        self.delivered = True
        for record in self.records:
            record.delivered = True


def request_signature(body: dict) -> str:
    return json.dumps({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, sort_keys=True,
                      default=str)


def session_calls(book: SessionBook, inbox: CallInbox, settings: ServeSettings) -> Callable:
    """`serve(session, body, call, tools_on, route, request)`: a request's reply (a dict, or a StreamingResponse),
    for the routes of gateway/server.py, run in the server's event loop."""
    tokenizer = book.renderer.tokenizer
    calls_made = [0]

    def decode_one(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    async def serve(session: Session, body: dict, call: ChatCall, tools_on: bool, route: str, request: Request):
        try:
            options = read_options(body, route, settings.sampling)
        except SessionError:
            book.counts["fields_refused"] += 1
            raise
        signature = request_signature(body)
        attempt = session.attempt
        if attempt is not None and attempt.signature == signature and not attempt.delivered:
            book.counts["calls_replayed"] += 1  # a retry, or the same call sent twice: one sample, one reply
        elif attempt is not None and not attempt.task.done():
            book.counts["calls_busy"] += 1
            raise SessionError(409, f"session {session.session_id} has a call in flight; a session's calls are one "
                               "sequence: send the next once its reply came (the same request again is answered "
                               "with that reply), or open another session for parallel work")
        else:
            attempt = start(session, call, options, tools_on, signature)
        chat = route == "chat"
        if options.stream:
            return StreamingResponse(stream(attempt, options, tools_on, chat), media_type="text/event-stream")
        try:
            choices = await asyncio.shield(attempt.task)
        except CallAborted as err:
            raise SessionError(503, "the engine aborted this call; the session will not be trained") from err
        if await request.is_disconnected():  # the reply reaches no one: kept for a retry, trained only if delivered
            raise SessionError(499, "the client disconnected before its reply; a retry of the same request gets it")
        attempt.deliver()
        return reply_body(attempt, choices, options, chat)

    def start(session: Session, call: ChatCall, options: CallOptions, tools_on: bool, signature: str) -> Attempt:
        """Plan the request's prompt and put its `n` calls into the engine, as an Attempt of `session`."""
        if options.n > settings.max_calls_in_flight:
            raise SessionError(400, f"n={options.n} is more than gateway.max_calls_in_flight="
                               f"{settings.max_calls_in_flight} calls; ask for fewer choices", param="n")
        if inbox.in_flight + options.n > settings.max_calls_in_flight:
            book.counts["calls_refused"] += 1
            raise SessionError(429, f"{settings.max_calls_in_flight} calls are in flight on this engine "
                               "(gateway.max_calls_in_flight); retry after the Retry-After seconds")
        try:
            plan = session.episode.plan(call)
        except Exception as err:  # the chat template refused these messages (jinja raised)
            raise SessionError(400, f"the chat template could not render these messages: {err}") from err
        room = settings.max_model_len - len(plan.prompt_ids)
        if room < 1:
            raise SessionError(400, f"the prompt has {len(plan.prompt_ids)} tokens; the engine's context is "
                               f"{settings.max_model_len}")
        asked = options.max_tokens
        max_tokens = min(asked or settings.max_tokens, settings.max_tokens, room)
        book.counts["clamped_max_tokens"] += asked is not None and max_tokens < asked
        calls_made[0] += 1
        attempt = Attempt(signature, calls_made[0], len(plan.prompt_ids))
        loop = asyncio.get_running_loop()
        futures = []
        for i in range(options.n):
            heard = None
            if options.stream:  # copied ids after each engine step: only for a stream
                def heard(ids, i=i):
                    loop.call_soon_threadsafe(attempt_heard, attempt, i, ids)
            seeded = replace(options, seed=None if options.seed is None else options.seed + i)
            futures.append(asyncio.wrap_future(inbox.submit(plan.prompt_ids, max_tokens, heard, seeded)))
        session.calls_in_flight += 1
        attempt.task = asyncio.ensure_future(run(session, attempt, call, plan, futures, options, tools_on))
        attempt.task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read, whoever awaits it
        session.attempt = attempt
        return attempt

    def attempt_heard(attempt: Attempt, index: int, ids: list[int]) -> None:
        for queue in attempt.listeners:
            queue.put_nowait((index, ids))

    async def run(session: Session, attempt: Attempt, call: ChatCall, plan, futures: list, options: CallOptions,
                  tools_on: bool) -> list[Choice]:
        try:
            try:
                results: list[CallResult] = await asyncio.gather(*futures)
            except CallAborted:
                book.lose_call(session)
                raise
            return [record(session, attempt, call, plan, result, options, tools_on, k)
                    for k, result in enumerate(results)]
        finally:  # after the record: a reward may come as soon as a client reads the reply
            session.calls_in_flight -= 1

    def record(session: Session, attempt: Attempt, call: ChatCall, plan, result: CallResult, options: CallOptions,
               tools_on: bool, index: int) -> Choice:
        """One choice as an OpenAI message, recorded in the session's episode (undelivered until a client gets it)."""
        text = tokenizer.decode(result.sampled_ids, skip_special_tokens=True)
        if options.stop:
            text = cut_at_stop(text, options.stop, options.keep_stop)
        tag = f"{attempt.number}" if options.n == 1 else f"{attempt.number}_{index}"
        reply = parse_hermes(text, f"call_{session.session_id}_{tag}") if tools_on else None
        if reply is not None and reply.error:
            book.counts["tool_parse_failures"] += 1
        message = reply.message() if reply is not None else {"role": "assistant", "content": text}
        attempt.records.append(session.episode.record(
            call, plan, message, result.sampled_ids, result.behavior_logprobs, result.token_versions,
            result.finish_reason, delivered=False, client=dict(options.recorded)))
        book.counts["calls"] += 1
        finish = "tool_calls" if message.get("tool_calls") else result.finish_reason
        return Choice(message, finish, list(result.sampled_ids), list(result.behavior_logprobs), result.top_logprobs)

    def logprobs(choice: Choice, options: CallOptions, chat: bool) -> dict | None:
        if options.top_logprobs is None:
            return None
        form = chat_logprobs if chat else completion_logprobs
        name = (lambda token_id: f"token_id:{token_id}") if options.token_id_names else decode_one
        return form(choice, name, options.top_logprobs)

    def reply_body(attempt: Attempt, choices: list[Choice], options: CallOptions, chat: bool) -> dict:
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{attempt.number}", "created": int(time.time()),
                "model": settings.model_name}
        items = []
        for i, c in enumerate(choices):
            if chat:
                item = {"index": i, "message": c.message, "finish_reason": c.finish_reason,
                        "logprobs": logprobs(c, options, chat)}
            else:
                item = {"index": i, "text": c.message["content"] or "", "finish_reason": c.finish_reason,
                        "logprobs": logprobs(c, options, chat)}
            if options.return_token_ids:
                item["token_ids"] = c.sampled_ids
            items.append(item)
        body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": items,
                "usage": usage(attempt.prompt_tokens, choices)}
        if chat:
            body["service_tier"] = "default"
        if options.return_token_ids:
            body["prompt_token_ids"] = list(attempt.records[0].plan.prompt_ids) if attempt.records else []
        return body

    async def stream(attempt: Attempt, options: CallOptions, tools_on: bool, chat: bool) -> AsyncIterator[str]:
        """A streamed reply: each choice's text as the engine samples it (after each engine step, decoded whole and
        sent from where the last event ended; text that may start a stop string, or with tools a `<tool_call>`,
        waits), then the rest of each choice, its tool calls, its finish with its log-probs, the usage and [DONE].
        A client that leaves before the end leaves the attempt undelivered (a retry gets its reply)."""
        send = Chunks(f"{'chatcmpl' if chat else 'cmpl'}-{attempt.number}", int(time.time()), settings.model_name,
                      chat)
        heard: asyncio.Queue = asyncio.Queue()
        attempt.listeners.append(heard)
        sent = [""] * options.n
        news = None
        try:
            if chat:
                for i in range(options.n):
                    yield send(i, {"role": "assistant", "content": ""})
            while not attempt.task.done():
                news = asyncio.ensure_future(heard.get())
                await asyncio.wait({attempt.task, news}, return_when=asyncio.FIRST_COMPLETED)
                if not news.done():
                    news.cancel()
                    break
                latest = dict([news.result()])
                while not heard.empty():  # each holds every id so far: the newest says all
                    index, ids = heard.get_nowait()
                    latest[index] = ids
                for index, ids in sorted(latest.items()):
                    text = streamable(tokenizer.decode(ids, skip_special_tokens=True), tools_on, options.stop)
                    if len(text) > len(sent[index]) and text.startswith(sent[index]):
                        yield send(index, {"content": text[len(sent[index]):]})
                        sent[index] = text
            try:
                choices: list[Choice] = await asyncio.shield(attempt.task)
            except CallAborted:
                yield error_event(503, "the engine aborted this call; the session will not be trained")
                return
            for i, c in enumerate(choices):
                rest = (c.message.get("content") or "")[len(sent[i]):]
                if rest:
                    yield send(i, {"content": rest})
                for k, tool_call in enumerate(c.message.get("tool_calls") or []):
                    yield send(i, {"tool_calls": [{"index": k, **tool_call}]})
                yield send(i, {}, c.finish_reason, logprobs(c, options, chat))
            if options.include_usage:
                yield send.usage(usage(attempt.prompt_tokens, choices))
            yield "data: [DONE]\n\n"
            attempt.deliver()
        finally:
            if news is not None and not news.done():  # the client left while the stream waited
                news.cancel()
            attempt.listeners.remove(heard)

    return serve
