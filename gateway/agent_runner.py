"""An in-process agent fed by the run's own prompts (gateway.agent): for each group the controller leases to a
rollout worker, the worker hands the prompt here instead of to its decode loop, and the agent function runs
`rollout.samples_per_prompt` times at once, each run in its own session of the worker's endpoint. The sessions
carry the leased group's id (gateway/sessions.py `create(leased=True)`), so their episodes form that group and end
its lease: the worker takes the group from the session book as any session group, or its drop, by reason.

The agent is `async def run(task, base_url, api_key) -> float | dict | None`, written against the OpenAI API (the
stock `openai` SDK on `base_url` with `api_key`). Its return value is the session's reward; None, an exception,
a bad reward or a run past gateway.agent_timeout_s leaves the session untrained, counted by kind. It runs in an
event loop on a thread of its own, so a slow agent never holds the server's loop or the worker's decode loop."""

import asyncio
import inspect
import logging
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable

from gateway.server import GatewayServer
from gateway.sessions import Session, SessionBook, SessionError
from protocols.trajectory import Prompt
from rewards.environment import reset_row
from rewards.tools import load_target

log = logging.getLogger(__name__)

COUNTER_NAMES = ("agent_runs", "agent_rewards", "agent_no_reward", "agent_errors", "agent_timeouts",
                 "agent_bad_rewards", "agent_groups", "agent_groups_refused", "agent_groups_after_stop")
"""`counts` keys, all present from the start: agent runs started; runs that returned a reward; runs that returned
None; runs that raised; runs cancelled at gateway.agent_timeout_s; rewards the session refused (not a finite
number, or the session had finished); leased groups started; groups whose sessions the endpoint could not open
(gateway.max_sessions; dropped `sessions_refused`); groups whose outcome came after the worker had stopped and
reported them aborted (ignored)."""


def load_agent(target: str) -> Callable[..., Any]:
    """The agent function a `module:function` setting names; it must be `async def run(task, base_url, api_key)`."""
    fn = load_target("gateway.agent", target, "function")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"gateway.agent={target!r} is not an async function: write it as "
                         "`async def run(task, base_url, api_key) -> float | dict | None`")
    return fn


def task_row(prompt: Prompt) -> dict[str, Any]:
    """The `task` an agent gets: the prompt's row as the data loader kept it (`prompt` its text, `answer`,
    `prompt_id` and its metadata fields), as an environment's `reset` gets it."""
    return reset_row(prompt)


class AgentRunner:
    """The leased groups an agent plays on one worker's endpoint. The worker calls `start` for each granted group,
    `claim` for each group the book hands back, `abort` when it stops; `in_flight` counts the groups it plays."""

    def __init__(self, target: str | Callable[..., Any], server: GatewayServer, book: SessionBook,
                 group_size: int, timeout_s: float, max_running: int = 64) -> None:
        self.fn = load_agent(target) if isinstance(target, str) else target
        """The agent function: gateway.agent's, or an adapter's (gateway/verifiers_env.py `VerifiersAgent`)."""
        self.server = server
        self.book = book
        self.group_size = group_size
        self.timeout_s = timeout_s
        self.active: dict[str, Future] = {}
        """Leased group id -> the future of its runs, from `start` until the worker claims the group's outcome."""
        self.counts: Counter = Counter({name: 0 for name in COUNTER_NAMES})
        self._aborted: set[str] = set()
        """Groups reported aborted at a stop whose outcome has not come yet."""
        self._lock = threading.Lock()  # counts are written from the agents' loop, read from the worker's thread
        self.loop = asyncio.new_event_loop()
        self._slots = asyncio.Semaphore(max_running)
        """Runs at once (gateway.max_calls_in_flight): the others wait here, so a worker holding many leased groups
        does not send the endpoint more calls than it serves, which would answer them 429."""
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-agents", daemon=True)
        self.thread.start()

    @property
    def in_flight(self) -> int:
        return len(self.active)

    def start(self, group_id: str, prompt: Prompt) -> None:
        """Play `prompt` `group_size` times, in sessions that form the leased group `group_id`."""
        self._count("agent_groups")
        self.active[group_id] = asyncio.run_coroutine_threadsafe(self._group(group_id, prompt), self.loop)

    def claim(self, group_id: str) -> bool:
        """The book handed back `group_id`'s outcome: True if this runner still plays it (the worker then passes
        it on), False for a group reported aborted at a stop (ignored, counted) or one the runner never had."""
        if self.active.pop(group_id, None) is not None:
            return True
        if group_id in self._aborted:
            self._aborted.discard(group_id)
            self._count("agent_groups_after_stop")
        return False

    def abort(self) -> list[str]:
        """The worker stops: every group in play is cancelled and forgotten (the worker reports them aborted); its
        sessions finish untrained, and an outcome that still comes is ignored. Returns their ids."""
        ids = list(self.active)
        for future in self.active.values():
            future.cancel()
        self._aborted.update(ids)
        self.active.clear()
        return ids

    def report(self) -> dict[str, float]:
        with self._lock:
            adapter = dict(getattr(self.fn, "counts", {}))  # an adapter's own counts (gateway.verifiers_env)
            return {**self.counts, **adapter, "agent_groups_in_flight": len(self.active)}

    def close(self) -> None:
        self.abort()
        if hasattr(self.fn, "close"):  # an adapter's resources live in this loop (gateway.verifiers_env's serving)
            try:
                asyncio.run_coroutine_threadsafe(self.fn.close(), self.loop).result(timeout=30)
            except Exception as err:  # noqa: BLE001 - a failed teardown is logged; the worker still stops
                log.warning("gateway agent's close raised: %s: %s", type(err).__name__, err)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    # --- in the agents' event loop ----------------------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    async def _on_server(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.server.call(fn, *args))

    async def _group(self, group_id: str, prompt: Prompt) -> None:
        try:
            sessions = await self._on_server(self._create, group_id)
        except SessionError as err:  # the group still comes back, dropped, so its lease ends
            log.warning("gateway.agent: no sessions for leased group %s: %s", group_id, err.message)
            self._count("agent_groups_refused")
            self.book.dropped_groups.put((group_id, "sessions_refused"))
            return
        task = task_row(prompt)
        runs = [asyncio.ensure_future(self._run(dict(task), s)) for s in sessions]
        try:
            await asyncio.gather(*runs)
        except asyncio.CancelledError:  # the worker stopped: the sessions finish untrained
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise

    def _create(self, group_id: str) -> list[Session]:
        # all at once in the server's loop: no client can take a seat in the leased group between them, and the
        # room is checked first, so a refusal leaves no part of a group behind
        if self.book.open_sessions + self.group_size > self.book.max_sessions:
            raise SessionError(429, f"{self.book.open_sessions} sessions are open and the group needs "
                               f"{self.group_size} more (gateway.max_sessions={self.book.max_sessions}); raise it "
                               "above rollout.prompts_in_flight x rollout.samples_per_prompt")
        return [self.book.create(group_id, self.group_size, leased=True) for _ in range(self.group_size)]

    async def _run(self, task: dict[str, Any], session: Session) -> None:
        base_url = f"{self.server.url}/sessions/{session.session_id}/v1"
        try:
            async with self._slots:
                self._count("agent_runs")
                value = await asyncio.wait_for(self.fn(task, base_url, session.api_key), self.timeout_s)
            outcome = "agent_no_reward" if value is None else (
                "agent_rewards" if await self._on_server(self._reward, session, value) else "agent_bad_rewards")
        except asyncio.TimeoutError:
            outcome = "agent_timeouts"
        except asyncio.CancelledError:
            await asyncio.shield(self._on_server(self.book.finish, session))
            raise
        except Exception as err:  # noqa: BLE001 - an agent's failure leaves its session untrained, never the worker
            outcome = "agent_errors"
            log.warning("gateway.agent raised on %s (session %s): %s: %s", task.get("prompt_id"),
                        session.session_id, type(err).__name__, err)
        self._count(outcome)
        await self._on_server(self.book.finish, session)  # (a no-op after a reward: it finished the session)

    def _reward(self, session: Session, value: Any) -> bool:
        try:
            self.book.set_reward(session, value)
            return True
        except SessionError as err:
            log.warning("gateway.agent's reward for session %s was refused: %s", session.session_id, err.message)
            return False
