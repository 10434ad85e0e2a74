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

Every request field is served or refused by name (gateway/request_fields.py); a session's calls are one
sequence (gateway/calls.py).

Statuses: 400 bad JSON or request (a refused field: `error.param` names it), 401 wrong key, 404 unknown session or
model, 409 a second reward or a second call while one runs, 410 a finished session, 429 over capacity (with
Retry-After), 503 a call the engine aborted (the session is then not trained)."""

import asyncio
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.calls import ServeSettings, session_calls
from gateway.engine_bridge import CallInbox
from gateway.episode import ChatCall
from gateway.sessions import Session, SessionBook, SessionError, finite

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Chat roles served; `developer` (OpenAI's newer name for instructions) renders as `system`."""
SWEEP_S = 0.5
"""How often the server finishes sessions past their deadline."""


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



def build_app(book: SessionBook, inbox: CallInbox, settings: ServeSettings, base_url: list[str]) -> FastAPI:
    """The endpoint's app. `base_url` holds the server's root URL once it is bound (uvicorn picks the port)."""
    app = FastAPI(title="relayrl session endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    renderer = book.renderer
    tokenizer = renderer.tokenizer
    serve = session_calls(book, inbox, settings)

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


    return app


def _chat_call(body: dict) -> tuple[ChatCall, bool]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise SessionError(400, "messages must be a non-empty list of chat messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise SessionError(400, f"messages[{i}] is not a chat message with a role in {list(ROLES)}",
                               param=f"messages[{i}]")
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise SessionError(400, f"messages[{i}].content[{j}] is a {kind!r} part; the endpoint serves text: "
                                   'send {"type": "text", "text": ...} parts or a string',
                                   param=f"messages[{i}].content")
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
