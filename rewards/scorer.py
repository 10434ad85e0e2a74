"""Scores responses with verifiers in a pool of child processes, each sample under a timeout.

The reward worker actor (actors/reward_worker.py) is a thin wrapper around `Scorer`. A verifier that raises,
hangs, or kills its process costs that sample reward 0 and an error count: the scorer soft-interrupts it
(SIGALRM) at `reward.timeout_s`, kills and replaces the process if that does not work, and carries on.
"""

import logging
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from protocols.metrics import reward_worker_metrics
from protocols.reward import RewardConfig
from protocols.trajectory import Prompt, ToolCall, TrajectoryGroup, VerifierResult

logger = logging.getLogger(__name__)

# Seconds after the soft timeout before a pool process is killed: room for the verifier to unwind.
_HARD_KILL_GRACE_S = 2.0
_STARTUP_TIMEOUT_S = 120.0
_MAX_CHUNK = 32
_MESSAGE_CHARS = 500

# One unit of work: single-form verifiers take one sample, batched ones a list. Items are
# (index, prompt, response, num_response_tokens, tool_calls).
Item = tuple[int, Prompt, str, int, list[ToolCall]]


@dataclass
class _Unit:
    verifier: str
    batched: bool
    items: list[Item]


@dataclass
class _Slot:
    proc: subprocess.Popen
    to_child: Connection
    from_child: Connection
    started: float
    ready: bool = False
    units: deque = field(default_factory=deque)
    deadline: float = math.inf


class Scorer:
    """Holds `reward.num_processes` verifier processes and the error counters of one reward worker."""

    def __init__(self, cfg: RewardConfig):
        from rewards.registry import resolve_verifier

        self.cfg = cfg
        resolve_verifier(cfg.verifier)  # fail here, with the registry's message, not in every sample
        self._batched: dict[str, bool] = {}
        self._counts: dict[str, float] = defaultdict(float)
        self._last_logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = defaultdict(int)
        self._slots = [self._spawn() for _ in range(cfg.num_processes)]

    # ----- public API -------------------------------------------------------------------------------------
    def score(self, prompts: list[Prompt], responses: list[str], num_tokens: list[int] | None = None,
              count: bool = True, tool_calls: list[list[ToolCall] | None] | None = None) -> list[VerifierResult]:
        """One result per response (the model's final answer), in order. Never raises for a verifier's failure:
        that sample gets reward 0 and `error` set to `exception`, `timeout` or `crash`. `count=False` (held-out
        evaluation) keeps these samples out of `metrics()`, except process restarts. `tool_calls` (one list or
        None per response) reaches the verifiers that ask for it (VerifierSpec.wants_tool_calls)."""
        num_tokens = num_tokens if num_tokens is not None else [0] * len(responses)
        calls = tool_calls if tool_calls is not None else [None] * len(responses)
        items = [(i, p, r, n, list(c or [])) for i, (p, r, n, c)
                 in enumerate(zip(prompts, responses, num_tokens, calls, strict=True))]
        results: list[VerifierResult | None] = [None] * len(items)
        kept = self._counts
        if not count:
            self._counts = defaultdict(float)
        try:
            self._run(self._make_units(items), results)
        finally:
            if not count:
                kept["restarts"] += self._counts["restarts"]
                self._counts = kept
        return results  # type: ignore[return-value]

    def score_group(self, group: TrajectoryGroup) -> TrajectoryGroup:
        """Fills `reward` and `result` of every trajectory (their `response_text` is already decoded). The
        verifier reads each one's final answer (`final_text`: all of it for a single-turn response). A sample with
        an environment reward (tools.environment) takes that as its `reward`; the verifier's stays in `result`
        (`correct` and `reward`) and the environment's is in `result.info["environment_reward"]`."""
        trajs = group.trajectories
        results = self.score(
            [t.prompt for t in trajs], [t.final_text for t in trajs], [len(t.response_token_ids) for t in trajs],
            tool_calls=[t.tool_calls for t in trajs],
        )
        for traj, result in zip(trajs, results, strict=True):
            traj.result = result
            traj.reward = result.reward
            if traj.environment_reward is not None:
                result.info["environment_reward"] = traj.environment_reward
                traj.reward = traj.environment_reward
        return group

    def counters(self) -> dict[str, float]:
        """Raw counts since the last call (samples, error_<kind>, restarts, verify_time_s, reward_sum, correct),
        then reset. The driver merges several workers' counters with protocols.metrics.reward_worker_metrics."""
        out, self._counts = dict(self._counts), defaultdict(float)
        return out

    def metrics(self) -> dict[str, float]:
        """`reward_worker/*` since the last call: samples, errors by kind, process restarts, seconds per sample,
        mean reward (verifier plus reward.shaping) and correct rate (protocols/metrics.py names them)."""
        return reward_worker_metrics([self.counters()])

    def close(self) -> None:
        for slot in self._slots:
            self._stop(slot)
        self._slots = []

    def __del__(self) -> None:
        if getattr(self, "_slots", None):
            self.close()

    # ----- scheduling -------------------------------------------------------------------------------------
    def _make_units(self, items: list[Item]) -> list[_Unit]:
        from rewards.registry import resolve_verifier

        units: list[_Unit] = []
        batches: dict[str, _Unit] = {}
        for item in items:
            name = item[1].verifier or self.cfg.verifier
            if name not in self._batched:
                self._batched[name] = resolve_verifier(name).batched
            if not self._batched[name]:
                units.append(_Unit(name, False, [item]))
            elif name in batches:
                batches[name].items.append(item)
            else:
                batches[name] = _Unit(name, True, [item])
        # A batched verifier gets at most a chunk's worth at once, so its timeout stays per-sample-sized.
        for unit in batches.values():
            for start in range(0, len(unit.items), _MAX_CHUNK):
                units.append(_Unit(unit.verifier, True, unit.items[start : start + _MAX_CHUNK]))
        return units

    def _budget(self, unit: _Unit) -> float:
        return self.cfg.timeout_s * len(unit.items)

    def _run(self, units: list[_Unit], results: list) -> None:
        pending = deque(units)
        while pending or any(slot.units for slot in self._slots):
            now = time.monotonic()
            for slot in self._slots:
                if slot.ready and not slot.units and pending:
                    size = max(1, min(_MAX_CHUNK, math.ceil(len(pending) / (2 * len(self._slots)))))
                    chunk = [pending.popleft() for _ in range(min(size, len(pending)))]
                    slot.units = deque(chunk)
                    slot.deadline = now + self._budget(chunk[0]) + _HARD_KILL_GRACE_S
                    slot.to_child.send(chunk)
            waiting = [s for s in self._slots if s.units or not s.ready]
            deadline = min(s.deadline if s.ready else s.started + _STARTUP_TIMEOUT_S for s in waiting)
            for conn in wait([s.from_child for s in waiting], timeout=max(0.0, deadline - time.monotonic())):
                slot = next(s for s in self._slots if s.from_child is conn)
                self._receive(slot, results, pending)
            now = time.monotonic()
            for i, slot in enumerate(self._slots):
                if slot.ready and slot.units and now > slot.deadline:
                    self._fail_current(slot, "timeout", f"no result after {self._budget(slot.units[0]):.1f} s; process killed", results)
                    self._replace(i, pending)
                elif not slot.ready and now > slot.started + _STARTUP_TIMEOUT_S:
                    raise RuntimeError(
                        f"a verifier process did not start within {_STARTUP_TIMEOUT_S:.0f} s (reward.verifier="
                        f"{self.cfg.verifier!r}); check that its module imports quickly and the host is not overloaded"
                    )

    def _receive(self, slot: _Slot, results: list, pending: deque) -> None:
        try:
            message = slot.from_child.recv()
        except (EOFError, OSError, pickle.UnpicklingError):
            index = self._slots.index(slot)
            if slot.units:
                self._fail_current(slot, "crash", f"verifier process exited (status {slot.proc.poll()})", results)
            elif not slot.ready:
                raise RuntimeError(f"a verifier process exited at start (status {slot.proc.wait()}); see its stderr") from None
            self._replace(index, pending)
            return
        kind = message[0]
        if kind == "ready":
            slot.ready = True
        elif kind == "init_error":
            raise RuntimeError(f"verifier process could not start: {message[1]}")
        elif kind == "unit":
            unit = slot.units.popleft()
            for index, result, error, text, seconds in message[1]:
                self._record(results, index, result, error, text, seconds, unit)
            if slot.units:
                slot.deadline = time.monotonic() + self._budget(slot.units[0]) + _HARD_KILL_GRACE_S

    def _fail_current(self, slot: _Slot, kind: str, text: str, results: list) -> None:
        unit = slot.units.popleft()
        for item in unit.items:
            self._record(results, item[0], None, kind, text, self.cfg.timeout_s if kind == "timeout" else 0.0, unit)

    def _record(self, results: list, index: int, result: dict | None, error: str, text: str, seconds: float,
                unit: _Unit) -> None:
        self._counts["samples"] += 1
        self._counts["verify_time_s"] += seconds
        if error:
            self._counts[f"error_{error}"] += 1
            prompt_id = next((it[1].prompt_id for it in unit.items if it[0] == index), "?")
            self._log_error(error, f"{text} (prompt {prompt_id})")
            results[index] = VerifierResult(reward=0.0, correct=False, info={"error": error, "message": text}, error=error)
            return
        parsed = VerifierResult.model_validate(result)
        self._counts["reward_sum"] += parsed.reward
        self._counts["correct"] += float(parsed.correct)
        results[index] = parsed

    def _log_error(self, kind: str, text: str) -> None:
        now = time.monotonic()
        last = self._last_logged.get(kind)
        if last is not None and now - last < self.cfg.error_log_interval_s:
            self._suppressed[kind] += 1
            return
        suppressed = self._suppressed.pop(kind, 0)
        self._last_logged[kind] = now
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        logger.warning("verifier %s: %s%s", kind, text[:_MESSAGE_CHARS], more)

    # ----- processes --------------------------------------------------------------------------------------
    def _spawn(self) -> _Slot:
        parent_read, child_write = os.pipe()
        child_read, parent_write = os.pipe()
        env = dict(os.environ)
        # The child imports what this process can import (user verifiers given as `module:function`).
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "rewards.scorer", str(child_read), str(child_write)],
            pass_fds=(child_read, child_write),
            env=env,
        )
        os.close(child_read)
        os.close(child_write)
        slot = _Slot(proc, Connection(parent_write, readable=False), Connection(parent_read, writable=False), time.monotonic())
        slot.to_child.send(self.cfg.model_dump())
        return slot

    def _replace(self, index: int, pending: deque) -> None:
        slot = self._slots[index]
        pending.extendleft(reversed(slot.units))  # the unfinished rest of its chunk goes back in line
        slot.units.clear()
        self._stop(slot, kill=True)
        self._counts["restarts"] += 1
        self._slots[index] = self._spawn()

    @staticmethod
    def _stop(slot: _Slot, kill: bool = False) -> None:
        if not kill:
            try:
                slot.to_child.send(None)
            except OSError:
                kill = True
        try:
            slot.proc.wait(timeout=0 if kill else 2)
        except subprocess.TimeoutExpired:
            pass
        if slot.proc.poll() is None:
            slot.proc.kill()
            slot.proc.wait()
        slot.to_child.close()
        slot.from_child.close()


# ----- child process ----------------------------------------------------------------------------------------
class _SoftTimeout(BaseException):
    """Raised by SIGALRM inside a verifier. A BaseException so a verifier's `except Exception` cannot eat it."""


def _on_alarm(signum, frame):
    raise _SoftTimeout()


def _run_unit(unit: _Unit, cfg: RewardConfig, specs: dict | None = None) -> list[tuple]:
    """Score one unit. `specs`: the process's verifiers by name, each resolved (imported) on its first unit."""
    from rewards.registry import resolve_verifier
    from rewards.shaping import as_result, compose

    specs = {} if specs is None else specs
    spec = specs.get(unit.verifier) or specs.setdefault(unit.verifier, resolve_verifier(unit.verifier))
    start = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, cfg.timeout_s * len(unit.items))
        try:
            if unit.batched:
                extra = {"tool_calls": [it[4] for it in unit.items]} if spec.wants_tool_calls else {}
                raw = list(spec.fn([it[1] for it in unit.items], [it[2] for it in unit.items], **extra))
                if len(raw) != len(unit.items):
                    raise ValueError(f"batched verifier {unit.verifier!r} returned {len(raw)} results for {len(unit.items)} responses")
            else:
                extra = {"tool_calls": unit.items[0][4]} if spec.wants_tool_calls else {}
                raw = [spec.fn(unit.items[0][1], unit.items[0][2], **extra)]
            shaped = [compose(as_result(r, unit.verifier), it[2], it[3], cfg.shaping) for r, it in zip(raw, unit.items, strict=True)]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _SoftTimeout:
        seconds = time.perf_counter() - start
        text = f"verifier {unit.verifier!r} passed reward.timeout_s={cfg.timeout_s}"
        return [(it[0], None, "timeout", text, seconds / len(unit.items)) for it in unit.items]
    except Exception as err:  # noqa: BLE001 - any verifier failure becomes an `exception` error for its samples
        seconds = time.perf_counter() - start
        text = f"{type(err).__name__}: {err}"
        return [(it[0], None, "exception", text, seconds / len(unit.items)) for it in unit.items]
    seconds = (time.perf_counter() - start) / len(unit.items)
    out = []
    for r, it in zip(shaped, unit.items, strict=True):
        try:
            out.append((it[0], _plain(r.model_dump()), "", "", seconds))
        except ValueError as err:  # one sample's info, not the process: the others keep their results
            out.append((it[0], None, "exception", f"verifier {unit.verifier!r} returned info that {err}", seconds))
    return out


def _plain(result: dict) -> dict:
    """Info values a verifier returned become JSON types, so the result pickles and checkpoints as text. Raises
    ValueError for info JSON cannot hold (it would otherwise end the process): nested past the encoder's recursion
    limit, or an integer past Python's int-to-text limit (a parsed answer of 5,000 digits)."""
    import json

    try:
        result["info"] = json.loads(json.dumps(result["info"], default=repr))
    except RecursionError as err:
        raise ValueError("nests too deep to write as JSON") from err
    except ValueError as err:
        raise ValueError(f"cannot be written as JSON ({err})") from err
    return result


def setup_verifiers(cfg: RewardConfig) -> None:
    """What a pool process does once before scoring: resolve `reward.verifier` (importing a user's module) and
    hand `cfg` to every registered verifier's own `configure` hook. The scorer names no verifier."""
    from rewards.registry import configure_verifiers, resolve_verifier

    resolve_verifier(cfg.verifier)
    configure_verifiers(cfg)


def _watch_parent(parent_pid: int) -> None:
    # A hung verifier never reads the closed pipe, so the process would outlive a killed reward worker.
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _child_main(read_fd: int, write_fd: int) -> None:
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    cfg = RewardConfig.model_validate(inbox.recv())
    try:
        setup_verifiers(cfg)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises with this text
        outbox.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    outbox.send(("ready",))
    specs: dict = {}
    while True:
        try:
            chunk = inbox.recv()
        except EOFError:
            return
        if chunk is None:
            return
        for unit in chunk:
            outbox.send(("unit", _run_unit(unit, cfg, specs)))


if __name__ == "__main__":
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
