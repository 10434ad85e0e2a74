"""The session endpoint's HTTP surface (FastAPI, served by uvicorn in a thread on 127.0.0.1): what an agent program
written with the stock `openai` SDK talks to. Each call's prompt is built by the session's episode
(gateway/episode.py), sampled by the engine through the decode loop (gateway/engine_bridge.py), its tool calls
read by gateway/hermes.py, and answered as plain OpenAI JSON, or streamed as SSE chunks while the engine samples.

    POST /sessions                                -> {session_id, base_url, api_key, expires_in_s}
    GET  /sessions/{id}/v1/models, /sessions/{id}/v1/models/{model}
    POST /sessions/{id}/v1/chat/completions       (stream or not)
    POST /sessions/{id}/v1/completions            (stream or not)
    POST /sessions/{id}/reward                    1.0, {"reward": 1.0} or {"reward": {"reward": 1.0, ...}}
    POST /sessions/{id}/finish
    the same /v1 routes without /sessions/{id}: the Bearer key selects the session

Every request field is served or refused by name (gateway/request_fields.py). A session's calls are one sequence:
each request runs as an `Attempt`, apart from the HTTP request that asked, and is recorded when the engine ends
it whether or not its client stayed; the same request sent again (an SDK's retry after a timeout, or sent twice
at once) is answered with that attempt's reply, so it is sampled and trained once; another call while one runs
is refused 409.

Statuses: 400 bad JSON or request (a refused field: `error.param` names it), 401 wrong key, 404 unknown session or
model, 409 a second reward or a second call while one runs, 410 a finished session, 429 over capacity (with
Retry-After), 503 a call the engine aborted (the session is then not trained)."""

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.engine_bridge import CallAborted, CallInbox, CallResult
from gateway.episode import CallRecord, ChatCall
from gateway.hermes import parse_hermes
from gateway.replies import (Choice, Chunks, chat_logprobs, completion_logprobs, cut_at_stop, error_event,
                             streamable, usage)
from gateway.request_fields import CallOptions, Sampling, read_options
from gateway.sessions import Session, SessionBook, SessionError, finite

ROLES = ("system", "user", "assistant", "tool")
SWEEP_S = 0.5
"""How often the server finishes sessions past their deadline."""
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


def _error(status: int, message: str, retry_after: int | None = None, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "session_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status,
                        headers=headers)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused with 413 once it passes `limit` bytes (its declared length first, then what
    arrives: a client may declare none, or lie)."""
    too_long = SessionError(413, f"the body is over gateway.max_request_bytes={limit} bytes; send less, or raise "
                                 "the setting")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_long
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_long
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_body(request: Request, limit: int, number: bool = False) -> dict | int | float:
    """The request's JSON object (`number`: or a bare number, as the reward route takes)."""
    try:
        body = json.loads(await _read_body(request, limit) or b"{}")
    except ValueError as err:
        raise SessionError(400, f"the body is not JSON ({err})") from err
    except RecursionError as err:  # the decoder recurses once per level of nesting
        raise SessionError(400, "the body is not JSON a client sends: it nests deeper than the decoder reads") from err
    if number and isinstance(body, (int, float)) and not isinstance(body, bool):
        return body
    if not isinstance(body, dict):
        raise SessionError(400, "the body must be a JSON object")
    return body


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


def _signature(body: dict) -> str:
    return json.dumps({k: v for k, v in body.items() if k not in ("stream", "stream_options")}, sort_keys=True,
                      default=str)


def build_app(book: SessionBook, inbox: CallInbox, settings: ServeSettings, base_url: list[str]) -> FastAPI:
    """The endpoint's app. `base_url` holds the server's root URL once it is bound (uvicorn picks the port)."""
    app = FastAPI(title="relayrl session endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    renderer = book.renderer
    tokenizer = renderer.tokenizer
    calls_made = [0]

    def decode_one(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, err: SessionError):
        return _error(err.status, err.message, settings.retry_after_s if err.status == 429 else None, err.param)

    @app.post("/sessions")
    async def create_session(request: Request):
        body = await _json_body(request, settings.max_request_bytes)
        timeout = body.get("timeout_s")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
                                    or not finite(timeout)):
            raise SessionError(400, f"timeout_s={str(timeout)[:40]}: a positive number of seconds")
        session = book.create(body.get("group"), body.get("group_size"), timeout)
        return {"session_id": session.session_id, "api_key": session.api_key,
                "base_url": f"{base_url[0]}/sessions/{session.session_id}/v1",
                "expires_in_s": round(session.deadline - book.clock(), 3)}

    def outcome(session: Session) -> dict:
        trained, reason = book.outcome(session)
        return {"trained": trained, **({"reason": reason} if reason else {})}

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request):
        session = book.get(session_id, _bearer(request))
        body = await _json_body(request, settings.max_request_bytes, number=True)
        if not isinstance(body, dict):
            body = {"reward": body}
        if "reward" not in body:
            raise SessionError(400, 'send NUMBER, {"reward": NUMBER} or {"reward": {"reward": NUMBER, ...}}')
        book.set_reward(session, body["reward"])
        return {"session_id": session_id, "reward": session.reward, "calls": len(session.episode.calls),
                **outcome(session)}

    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        session = book.get(session_id, _bearer(request))
        book.finish(session)
        return {"session_id": session_id, **outcome(session)}

    def model(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "relayrl"}

    def one_model(name: str) -> dict:
        if name != settings.model_name:
            raise SessionError(404, f"no model {name!r}: this endpoint serves {settings.model_name!r} (GET /v1/models)",
                               param="model")
        return model(name)

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str, request: Request):
        book.get(session_id, _bearer(request))
        return {"object": "list", "data": [model(settings.model_name)]}

    @app.get("/sessions/{session_id}/v1/models/{name:path}")
    async def session_model(session_id: str, name: str, request: Request):
        book.get(session_id, _bearer(request))
        return one_model(name)

    @app.get("/v1/models")
    async def key_models(request: Request):
        book.get(None, _bearer(request))
        return {"object": "list", "data": [model(settings.model_name)]}

    @app.get("/v1/models/{name:path}")
    async def key_model(name: str, request: Request):
        book.get(None, _bearer(request))
        return one_model(name)

    async def chat(session_id: str | None, request: Request):
        session = book.get(session_id, _bearer(request))
        book.check_open(session)
        body = await _json_body(request, settings.max_request_bytes)
        call, tools_on = _chat_call(body)
        return await serve(session, body, call, tools_on and settings.tool_parser == "hermes", "chat", request)

    async def completion(session_id: str | None, request: Request):
        session = book.get(session_id, _bearer(request))
        book.check_open(session)
        body = await _json_body(request, settings.max_request_bytes)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            ids = renderer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         and 0 <= t < len(tokenizer) for t in prompt):
            ids = prompt
        else:
            raise SessionError(400, "prompt must be a string or a non-empty list of token ids (one prompt per call)",
                               param="prompt")
        return await serve(session, body, ChatCall([], prompt_ids=tuple(ids)), False, "completions", request)

    app.post("/sessions/{session_id}/v1/chat/completions")(chat)
    app.post("/sessions/{session_id}/v1/completions")(completion)

    @app.post("/v1/chat/completions")
    async def key_chat(request: Request):
        return await chat(None, request)

    @app.post("/v1/completions")
    async def key_completion(request: Request):
        return await completion(None, request)

    async def serve(session: Session, body: dict, call: ChatCall, tools_on: bool, route: str, request: Request):
        try:
            options = read_options(body, route, settings.sampling)
        except SessionError:
            book.counts["fields_refused"] += 1
            raise
        signature = _signature(body)
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

    return app


def _chat_call(body: dict) -> tuple[ChatCall, bool]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SessionError(400, "messages must be a non-empty list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise SessionError(400, f"messages[{i}] is not a chat message with a role in {list(ROLES)}")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise SessionError(400, "tools must be a list of OpenAI tool objects")
    args = body.get("chat_template_kwargs") or {}
    if not isinstance(args, dict):
        raise SessionError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    tools_on = tools is not None and body.get("tool_choice") != "none"
    return ChatCall(messages, tools, args), tools_on


class GatewayServer:
    """uvicorn serving the app in a daemon thread; `url` once started (port 0 picks a free port)."""

    def __init__(self, book: SessionBook, inbox: CallInbox, settings: ServeSettings, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        import uvicorn

        self._base = [""]
        self.app = build_app(book, inbox, settings, self._base)
        self.book = book
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.host = host
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop the app (and so the session book) runs in, once started."""
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), name="gateway-http", daemon=True)

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """`fn(*args)` run in the server's event loop, as the routes run (the session book is not thread-safe):
        for in-process callers in other threads (gateway/agent_runner.py). A future of its result."""
        async def run() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        async def sweep() -> None:  # deadlines pass with no request to notice them
            while True:
                await asyncio.sleep(SWEEP_S)
                self.book.sweep()

        sweeper = asyncio.create_task(sweep())
        try:
            await self.server.serve()
        finally:
            sweeper.cancel()

    def start(self, timeout_s: float = 30.0) -> "GatewayServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the session endpoint did not start on {self.host} within {timeout_s} s "
                                   "(is gateway.port taken?)")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self._base[0] = f"http://{self.host}:{port}"
        return self

    @property
    def url(self) -> str:
        return self._base[0]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
