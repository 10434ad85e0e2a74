"""How the session endpoint's calls reach an engine: through the rollout worker's decode loop
(actors/decode_loop.py `start_call`), so a call is stepped with the worker's groups, stamped with the version of
the weights that sampled each token, and never aborted by a weight update.

The server's thread submits calls (`submit`, thread-safe); the thread that owns the decode loop calls `pump`
before each engine step, which starts the new calls and completes those that ended. `EngineThread` is that
owner for an engine that serves only the endpoint (tests, a stand-alone server); in a run it is
`RolloutWorker.run`."""

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from actors.decode_loop import DecodeLoop
from actors.prefix_cache import GATEWAY_PREFIX
from protocols.trajectory import Trajectory


class CallAborted(Exception):
    """The engine stopped before the call ended (the worker stopped or its engine aborted)."""


@dataclass(frozen=True)
class CallResult:
    """What the engine did with one call."""

    sampled_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    """`stop` (EOS, a stop token or a stop string) or `length` (max_tokens)."""
    top_logprobs: list[dict[int, tuple[float, int]]] | None = None
    """With the request's `top_logprobs` set: per sampled token, token id -> (processed log-prob, rank) of the
    sampled token and the engine's likeliest alternatives (actors/decode_loop.py `call_logprobs`)."""

    @classmethod
    def of(cls, t: Trajectory, top_logprobs: list | None = None) -> "CallResult":
        return cls(list(t.response_token_ids), list(t.behavior_logprobs), list(t.token_versions), t.finish_reason,
                   top_logprobs)


class CallInbox:
    """Calls on their way into a decode loop and back. `make_params(max_tokens, options)` builds the engine's
    sampling parameters: the run's temperature and top_p, and the request's stop strings, seed and log-probs
    (`options`, gateway/request_fields.py `CallOptions`; None: none of them)."""

    def __init__(self, make_params: Callable[[int, Any], Any]) -> None:
        self.make_params = make_params
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, Future] = {}
        self._listeners: dict[str, Callable[[list[int]], None]] = {}
        """call id -> what hears its sampled ids after each engine step, for a streamed call (`submit`)."""
        self._count = 0
        self._lock = threading.Lock()

    def submit(self, prompt_ids: list[int], max_tokens: int,
               on_tokens: Callable[[list[int]], None] | None = None, options: Any = None) -> Future:
        """A future of the call's CallResult (or CallAborted); thread-safe. `on_tokens`, if given, is called from
        the decode loop's thread after each engine step that sampled for the call, with every id sampled so far
        (not after the last: the result has them); it must not block."""
        with self._lock:
            self._count += 1
            call_id = f"{GATEWAY_PREFIX}{self._count}"
        future: Future = Future()
        if on_tokens is not None:
            self._listeners[call_id] = on_tokens
        self._new.put((call_id, list(prompt_ids), max_tokens, options, future))
        return future

    def _heard(self, call_id: str, ids: list[int]) -> None:
        listener = self._listeners.get(call_id)
        if listener is not None:  # a copy: the engine appends to its list while the server's loop reads this one
            listener(list(ids))

    @property
    def in_flight(self) -> int:
        return self._new.qsize() + len(self._pending)

    def pump(self, decoding: DecodeLoop, start_new: bool = True) -> None:
        """From the decode loop's thread: complete the calls that ended (or that an abort dropped), then start the
        new ones unless `start_new` is False (the loop is about to stop: a call started then would stay in the
        engine and be stepped by the next offline `generate`, evaluation's, which cannot tell it from its own)."""
        decoding.on_call_tokens = self._heard
        for group in decoding.finished_calls:
            self._listeners.pop(group.group_id, None)
            future = self._pending.pop(group.group_id, None)
            if future is not None:
                top = getattr(decoding, "call_logprobs", {}).pop(group.group_id, None)
                future.set_result(CallResult.of(group.trajectories[0], top))
        decoding.finished_calls.clear()
        for call_id in [c for c in self._pending if c not in decoding.calls]:
            self._listeners.pop(call_id, None)
            self._pending.pop(call_id).set_exception(CallAborted(f"{call_id} was aborted by its engine"))
        while start_new:
            try:
                call_id, prompt_ids, max_tokens, options, future = self._new.get_nowait()
            except queue.Empty:
                break
            if future.cancelled():
                self._listeners.pop(call_id, None)
                continue
            self._pending[call_id] = future
            decoding.start_call(call_id, prompt_ids, self.make_params(max_tokens, options))

    def fail_all(self, reason: str) -> None:
        """Every call not yet ended fails (the worker stops serving)."""
        while True:
            try:
                *_, future = self._new.get_nowait()
            except queue.Empty:
                break
            future.set_exception(CallAborted(reason))
        for future in self._pending.values():
            future.set_exception(CallAborted(reason))
        self._pending.clear()
        self._listeners.clear()


class EngineThread:
    """A thread that steps a decode loop serving only the endpoint's calls; `version()` stamps the tokens."""

    IDLE_S = 0.002

    def __init__(self, decoding: DecodeLoop, inbox: CallInbox, version: Callable[[], int] = lambda: 0) -> None:
        self.decoding = decoding
        self.inbox = inbox
        self.version = version
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._iteration = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="gateway-engine", daemon=True)

    def start(self) -> "EngineThread":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._running.wait(self.IDLE_S):
                    continue
                with self._iteration:
                    if not self._running.is_set():
                        continue  # paused while this iteration waited for the lock
                    self.inbox.pump(self.decoding)
                    busy = self.decoding.has_unfinished()
                    if busy:
                        self.decoding.step(self.version())
                if not busy:
                    time.sleep(self.IDLE_S)
        finally:
            self.decoding.abort()
            self.inbox.fail_all("the engine thread stopped")

    def pause(self) -> None:
        """Stop stepping once the current step is done (calls wait in the inbox or the engine), until `resume`."""
        self._running.clear()
        with self._iteration:
            pass

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)
