"""The session endpoint's HTTP surface (FastAPI, served by uvicorn in a thread on 127.0.0.1): what an agent program
written with the stock `openai` SDK talks to. Each call's prompt is built by the session's episode
(gateway/episode.py), sampled by the engine through the decode loop (gateway/engine_bridge.py), its tool calls
read by gateway/hermes.py, and answered as plain OpenAI JSON, or streamed as SSE chunks while the engine samples.

    POST /sessions                                -> {session_id, base_url, api_key, expires_in_s}
    GET  /sessions/{id}/v1/models
    POST /sessions/{id}/v1/chat/completions       (stream or not)
    POST /sessions/{id}/v1/completions
    POST /sessions/{id}/reward                    {"reward": 1.0} or {"reward": {"reward": 1.0, ...}}
    POST /sessions/{id}/finish
    the same /v1 routes without /sessions/{id}: the Bearer key selects the session

Statuses: 400 bad JSON or request, 401 wrong key, 404 unknown session, 409 a second reward, 410 a finished
session, 429 over capacity (with Retry-After), 503 a call the engine aborted (the session is then not trained)."""

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.engine_bridge import CallAborted, CallInbox, CallResult
from gateway.episode import ChatCall
from gateway.hermes import CALL_START, parse_hermes
from gateway.sessions import Session, SessionBook, SessionError, finite

ROLES = ("system", "user", "assistant", "tool")
SWEEP_S = 0.5
"""How often the server finishes sessions past their deadline."""
IGNORED_SAMPLING = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty")
"""Request fields the run sets itself: the behavior policy must be the run's (its temperature enters the learner's
log-probs). A request that sets them is served with the run's values, and counted (`ignored_sampling`)."""


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


def _error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 429: "rate_limit_error"}.get(status, "session_error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


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


async def _json_body(request: Request, limit: int) -> dict:
    try:
        body = json.loads(await _read_body(request, limit) or b"{}")
    except ValueError as err:
        raise SessionError(400, f"the body is not JSON ({err})") from err
    except RecursionError as err:  # the decoder recurses once per level of nesting
        raise SessionError(400, "the body is not JSON a client sends: it nests deeper than the decoder reads") from err
    if not isinstance(body, dict):
        raise SessionError(400, "the body must be a JSON object")
    return body


def build_app(book: SessionBook, inbox: CallInbox, settings: ServeSettings, base_url: list[str]) -> FastAPI:
    """The endpoint's app. `base_url` holds the server's root URL once it is bound (uvicorn picks the port)."""
    app = FastAPI(title="relayrl session endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    renderer = book.renderer
    tokenizer = renderer.tokenizer
    calls_made = [0]

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, err: SessionError):
        return _error(err.status, err.message, settings.retry_after_s if err.status == 429 else None)

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

    @app.post("/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request):
        session = book.get(session_id, _bearer(request))
        body = await _json_body(request, settings.max_request_bytes)
        if "reward" not in body:
            raise SessionError(400, 'send {"reward": NUMBER} or {"reward": {"reward": NUMBER, ...}}')
        book.set_reward(session, body["reward"])
        return {"session_id": session_id, "reward": session.reward, "calls": len(session.episode.calls)}

    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        session = book.get(session_id, _bearer(request))
        book.finish(session)
        return {"session_id": session_id, "trained": session.reward is not None and not session.lost}

    def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "relayrl"}]}

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str, request: Request):
        book.get(session_id, _bearer(request))
        return models()

    @app.get("/v1/models")
    async def key_models(request: Request):
        book.get(None, _bearer(request))
        return models()

    async def chat(session_id: str | None, request: Request):
        session = book.get(session_id, _bearer(request))
        book.check_open(session)
        body = await _json_body(request, settings.max_request_bytes)
        call, tools_on = _chat_call(body)
        return await serve(session, body, call, tools_on and settings.tool_parser == "hermes", chat=True,
                           request=request)

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
            raise SessionError(400, "prompt must be a string or a non-empty list of token ids (one prompt per call)")
        return await serve(session, body, ChatCall([], prompt_ids=tuple(ids)), False, chat=False, request=request)

    app.post("/sessions/{session_id}/v1/chat/completions")(chat)
    app.post("/sessions/{session_id}/v1/completions")(completion)

    @app.post("/v1/chat/completions")
    async def key_chat(request: Request):
        return await chat(None, request)

    @app.post("/v1/completions")
    async def key_completion(request: Request):
        return await completion(None, request)

    async def serve(session: Session, body: dict, call: ChatCall, tools_on: bool, chat: bool, request: Request):
        if inbox.in_flight >= settings.max_calls_in_flight:
            book.counts["calls_refused"] += 1
            raise SessionError(429, f"{settings.max_calls_in_flight} calls are in flight on this engine "
                               "(gateway.max_calls_in_flight); retry after the Retry-After seconds")
        book.counts["ignored_sampling"] += any(k in body for k in IGNORED_SAMPLING)
        try:
            plan = session.episode.plan(call)
        except Exception as err:  # the chat template refused these messages (jinja raised)
            raise SessionError(400, f"the chat template could not render these messages: {err}") from err
        room = settings.max_model_len - len(plan.prompt_ids)
        if room < 1:
            raise SessionError(400, f"the prompt has {len(plan.prompt_ids)} tokens; the engine's context is "
                               f"{settings.max_model_len}")
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 1):
            raise SessionError(400, f"max_tokens={asked!r}: a positive integer")
        max_tokens = min(asked or settings.max_tokens, settings.max_tokens, room)
        book.counts["clamped_max_tokens"] += asked is not None and max_tokens < asked
        if chat and body.get("stream"):
            return StreamingResponse(stream(session, body, call, plan, tools_on, max_tokens),
                                     media_type="text/event-stream")
        session.calls_in_flight += 1
        try:
            result: CallResult = await asyncio.wrap_future(inbox.submit(plan.prompt_ids, max_tokens))
        except CallAborted as err:
            book.lose_call(session)
            raise SessionError(503, "the engine aborted this call; the session will not be trained") from err
        except asyncio.CancelledError:  # the client left while its call ran
            book.lose_call(session)
            raise
        finally:
            session.calls_in_flight -= 1
        if await request.is_disconnected():  # the client left while its call ran: the reply reaches no one
            book.lose_call(session)
            raise SessionError(499, "the client disconnected before its reply; the session will not be trained")
        calls_made[0] += 1
        message, finish, usage = record(session, call, plan, result, tools_on, calls_made[0])
        reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{session.session_id}-{calls_made[0]}"
        created = int(time.time())
        if not chat:
            return {"id": reply_id, "object": "text_completion", "created": created, "model": settings.model_name,
                    "choices": [{"index": 0, "text": message["content"] or "", "finish_reason": result.finish_reason,
                                 "logprobs": None}], "usage": usage}
        return {"id": reply_id, "object": "chat.completion", "created": created, "model": settings.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": usage}

    def record(session: Session, call: ChatCall, plan, result: CallResult, tools_on: bool,
               number: int) -> tuple[dict, str, dict]:
        """The call's reply as an OpenAI message, recorded in the session's episode: (message, finish reason,
        usage)."""
        text = tokenizer.decode(result.sampled_ids, skip_special_tokens=True)
        reply = parse_hermes(text, f"call_{session.session_id}_{number}") if tools_on else None
        if reply is not None and reply.error:
            book.counts["tool_parse_failures"] += 1
        message = reply.message() if reply is not None else {"role": "assistant", "content": text}
        session.episode.record(call, plan, message, result.sampled_ids, result.behavior_logprobs,
                               result.token_versions, result.finish_reason)
        book.counts["calls"] += 1
        finish = "tool_calls" if message.get("tool_calls") else result.finish_reason
        usage = {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": len(result.sampled_ids),
                 "total_tokens": len(plan.prompt_ids) + len(result.sampled_ids)}
        return message, finish, usage

    async def stream(session: Session, body: dict, call: ChatCall, plan, tools_on: bool,
                     max_tokens: int) -> AsyncIterator[str]:
        """A streamed chat call as OpenAI chat.completion.chunk events: the content as the engine samples it
        (after each engine step, decoded whole and sent from where the last event ended; with tools, text that
        may start a `<tool_call>` waits), then at the end the rest of the content, each tool call, the finish
        and the usage. A client that leaves before the last event lost the call: its session is not trained."""
        loop = asyncio.get_running_loop()
        heard: asyncio.Queue = asyncio.Queue()
        calls_made[0] += 1
        number = calls_made[0]
        send = _Chunks(f"chatcmpl-{session.session_id}-{number}", int(time.time()), settings.model_name)
        session.calls_in_flight += 1
        running, done, news = True, False, None
        try:
            future = asyncio.wrap_future(inbox.submit(
                plan.prompt_ids, max_tokens, lambda ids: loop.call_soon_threadsafe(heard.put_nowait, ids)))
            yield send({"role": "assistant", "content": ""})
            sent = ""
            while not future.done():
                news = asyncio.ensure_future(heard.get())
                await asyncio.wait({future, news}, return_when=asyncio.FIRST_COMPLETED)
                if not news.done():
                    news.cancel()
                    break
                ids = news.result()
                while not heard.empty():  # each holds every id so far: the newest says all
                    ids = heard.get_nowait()
                text = _streamable(tokenizer.decode(ids, skip_special_tokens=True), tools_on)
                if len(text) > len(sent) and text.startswith(sent):
                    yield send({"content": text[len(sent):]})
                    sent = text
            try:
                result: CallResult = future.result()
            except CallAborted:
                book.lose_call(session)
                done = True
                yield _error_event(503, "the engine aborted this call; the session will not be trained")
                return
            message, finish, usage = record(session, call, plan, result, tools_on, number)
            session.calls_in_flight -= 1  # recorded: a reward may come as soon as the client reads the end
            running = False
            rest = (message.get("content") or "")[len(sent):]
            if rest:
                yield send({"content": rest})
            for i, tool_call in enumerate(message.get("tool_calls") or []):
                yield send({"tool_calls": [{"index": i, **tool_call}]})
            yield send({}, finish)
            if (body.get("stream_options") or {}).get("include_usage"):
                yield send.usage(usage)
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if news is not None and not news.done():  # the client left while the stream waited
                news.cancel()
            if running:
                session.calls_in_flight -= 1
            if not done:
                book.lose_call(session)

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
        raise SessionError(400, "chat_template_kwargs must be an object")
    if not isinstance(body.get("stream_options") or {}, dict):  # read once the call ran, so refused before it
        raise SessionError(400, 'stream_options must be an object (e.g. {"include_usage": true})')
    tools_on = tools is not None and body.get("tool_choice", "auto") != "none"
    return ChatCall(messages, tools, args), tools_on


def _streamable(text: str, tools_on: bool) -> str:
    """The part of a reply's text so far that a stream may send: not a trailing partial character (decoded as
    U+FFFD), and with tools not from a `<tool_call>` on, nor a tail that may begin one, since the final parse
    (gateway/hermes.py) takes calls out of the content from there."""
    text = text.rstrip("\ufffd")
    if not tools_on:
        return text
    at = text.find(CALL_START)
    if at >= 0:
        return text[:at]
    for k in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(CALL_START[:k]):
            return text[:-k]
    return text


class _Chunks:
    """One streamed reply's chat.completion.chunk events."""

    def __init__(self, reply_id: str, created: int, model: str) -> None:
        self.head = {"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def __call__(self, delta: dict, finish_reason: str | None = None) -> str:
        data = {**self.head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                          "logprobs": None}]}
        return f"data: {json.dumps(data)}\n\n"

    def usage(self, usage: dict) -> str:
        return f"data: {json.dumps({**self.head, 'choices': [], 'usage': usage})}\n\n"


def _error_event(status: int, message: str) -> str:
    """An error after the stream began (its status was already sent): the SDK raises it as an APIError."""
    return f"data: {json.dumps({'error': {'message': message, 'type': 'session_error', 'code': status}})}\n\n"


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
