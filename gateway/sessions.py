"""The sessions of one endpoint: their keys, deadlines, rewards and episodes, and the groups of finished sessions
that go on to training. Runs in the server's event loop (gateway/server.py); the rollout worker takes finished
groups from `take_groups`, from its own thread.

A session is trained once it has its reward (POST /sessions/{id}/reward, which also finishes it). A session that
finishes without one (POST /finish, or its deadline) or that lost a call (an engine abort, a client that left
mid-call) is not trained, and is counted. Sessions created with the same `group` key form one group of
`group_size` sessions (group baselines compare them); a group goes on once all its sessions have finished."""

import math
import queue
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gateway.chat_render import ChatRenderer
from gateway.episode import SPLIT_REASONS, Episode, HistoryMode
from gateway.episode_samples import episode_samples
from protocols.trajectory import TrajectoryGroup

KEEP_FINISHED_S = 600.0
"""A finished session is remembered this long (a late call or reward is answered 410, not 404), then forgotten."""
COUNTER_NAMES = ("sessions", "sessions_rewarded", "sessions_no_reward", "sessions_lost", "calls", "calls_refused",
                 "calls_lost", "tool_parse_failures", "clamped_max_tokens", "ignored_sampling", "samples",
                 "retries", "retry_orphans", "groups", *(f"splits_{r}" for r in SPLIT_REASONS))
"""`counts` keys, all present from the start: sessions opened, trained, finished without reward, lost; calls
served, refused (429), lost; replies whose tool calls did not parse; requests whose max_tokens was lowered or whose
temperature/top_p/n/stop were overridden by the run's; samples and groups handed to training; retried calls and
the orphans dropped; new segments by reason."""


class SessionError(Exception):
    """A request the session cannot take: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Session:
    session_id: str
    api_key: str
    group: str
    deadline: float
    """time.monotonic() past which the session is finished."""
    episode: Episode
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    lost: bool = False
    calls_in_flight: int = 0
    finished_at: float = 0.0


@dataclass
class _Group:
    size: int
    sessions: list[Session] = field(default_factory=list)


class SessionBook:
    def __init__(self, renderer: ChatRenderer, history: HistoryMode, max_sessions: int, timeout_s: float,
                 worker_id: int = 0, clock=time.monotonic) -> None:
        self.renderer = renderer
        self.history = history
        self.max_sessions = max_sessions
        self.timeout_s = timeout_s
        self.worker_id = worker_id
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}
        self.groups: dict[str, _Group] = {}
        self.finished_groups: queue.SimpleQueue = queue.SimpleQueue()
        """TrajectoryGroups ready for training; the rollout worker takes them (`take_groups`)."""
        self.counts: Counter = Counter({name: 0 for name in COUNTER_NAMES})

    @property
    def open_sessions(self) -> int:
        return sum(not s.finished for s in self.sessions.values())

    def create(self, group: str | None = None, group_size: int = 1, timeout_s: float | None = None) -> Session:
        self.sweep()
        if self.open_sessions >= self.max_sessions:
            raise SessionError(429, f"{self.max_sessions} sessions are open (gateway.max_sessions); retry later")
        if not 1 <= group_size <= 1024:
            raise SessionError(400, f"group_size={group_size}: a group has 1 to 1024 sessions")
        session_id = secrets.token_hex(8)
        key = f"sk-relayrl-{secrets.token_urlsafe(24)}"
        group = group or f"session-{session_id}"
        g = self.groups.setdefault(group, _Group(group_size))
        if g.size != group_size or len(g.sessions) >= g.size:
            raise SessionError(409, f"group {group!r} has size {g.size} and {len(g.sessions)} sessions; a group's "
                               "sessions share one group_size and it cannot grow past it")
        timeout = self.timeout_s if timeout_s is None else min(float(timeout_s), self.timeout_s)
        session = Session(session_id, key, group, self.clock() + timeout, Episode(self.renderer, self.history))
        g.sessions.append(session)
        self.sessions[session_id] = session
        self.by_key[key] = session
        self.counts["sessions"] += 1
        return session

    def get(self, session_id: str | None, api_key: str | None) -> Session:
        """The session a request names: by id (the key must match) or, with no id, by its key alone."""
        if session_id is None:
            session = self.by_key.get(api_key or "")
            if session is None:
                raise SessionError(401, "no session has this API key; create one with POST /sessions")
            return session
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"no session {session_id!r}; create one with POST /sessions")
        if not secrets.compare_digest(api_key or "", session.api_key):
            raise SessionError(401, f"the API key is not session {session_id!r}'s (send it as a Bearer token)")
        return session

    def check_open(self, session: Session) -> None:
        self.sweep()
        if session.finished:
            raise SessionError(410, f"session {session.session_id} is finished; create a new one")

    def set_reward(self, session: Session, value: Any) -> None:
        """A number, or a dict with a number under `reward` (its other keys are kept as info); finishes it."""
        self.sweep()
        if session.reward is not None:
            raise SessionError(409, f"session {session.session_id} already has its reward {session.reward:g}")
        if session.finished:
            raise SessionError(410, f"session {session.session_id} finished before its reward came; not trained")
        if session.calls_in_flight:
            raise SessionError(409, f"session {session.session_id} has {session.calls_in_flight} calls in flight; "
                               "post the reward once they returned")
        info = {}
        if isinstance(value, dict):
            info = {k: v for k, v in value.items() if k != "reward"}
            value = value.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SessionError(400, f"reward {value!r}: send a finite number, or a dict with a number under "
                               '"reward" (e.g. {"reward": 1.0, "correct": true})')
        session.reward, session.info = float(value), info
        self.finish(session)

    def finish(self, session: Session) -> None:
        if session.finished:
            return
        session.finished = True
        session.finished_at = self.clock()
        if session.lost:
            self.counts["sessions_lost"] += 1
        elif session.reward is None:
            self.counts["sessions_no_reward"] += 1
        else:
            self.counts["sessions_rewarded"] += 1
        for name, value in session.episode.counts.items():
            if name.startswith("splits_") or name == "retries":
                self.counts[name] += value
        group = self.groups[session.group]
        if len(group.sessions) == group.size and all(s.finished for s in group.sessions):
            self._emit(session.group, group)

    def lose_call(self, session: Session) -> None:
        """A call that did not reach its client (engine abort, disconnect): the session is not trained."""
        session.lost = True
        self.counts["calls_lost"] += 1

    def _emit(self, name: str, group: _Group) -> None:
        del self.groups[name]
        trajectories = []
        for s in group.sessions:
            if s.lost or s.reward is None:
                continue
            samples, counts = episode_samples(
                s.episode.calls, f"session/{s.session_id}", f"session-group/{name}", s.reward, s.info,
                first_index=len(trajectories), worker_id=self.worker_id, correct=bool(s.info.get("correct", False)))
            trajectories += samples
            self.counts["retry_orphans"] += counts["retry_orphans"]
        if trajectories:
            self.counts["samples"] += len(trajectories)
            self.counts["groups"] += 1
            self.finished_groups.put(TrajectoryGroup(group_id=f"session-group/{name}", trajectories=trajectories))

    def sweep(self) -> None:
        """Finish the sessions past their deadline (no calls in flight: a call in flight ends first)."""
        now = self.clock()
        for session in list(self.sessions.values()):
            if not session.finished and now >= session.deadline and not session.calls_in_flight:
                self.finish(session)
            elif session.finished and now - session.finished_at > KEEP_FINISHED_S:
                del self.sessions[session.session_id]
                del self.by_key[session.api_key]

    def take_groups(self) -> list[TrajectoryGroup]:
        """Finished groups for training (thread-safe)."""
        out = []
        while True:
            try:
                out.append(self.finished_groups.get_nowait())
            except queue.Empty:
                return out
