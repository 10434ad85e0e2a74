"""The sessions of one endpoint: their keys, deadlines, rewards and episodes, and the groups of finished sessions
that go on to training. Runs in the server's event loop (gateway/server.py); the rollout worker takes finished
groups from `take_groups`, from its own thread.

A session is trained once it has its reward (POST /sessions/{id}/reward, which also finishes it). A session that
finishes without one (POST /finish, or its deadline) or that lost a call (the engine aborted it) is not trained,
and is counted; the reply of every route that ends a session says which (`trained`, `reason`). A call whose
client left keeps its session: its reply is kept for a retry of the same request, and trains only if the client
got it. Sessions created with the same `group` key (the same task, sampled
several times) form one group of `group_size` sessions, whose baseline compares them; sessions created without a
key fill anonymous groups in arrival order. A group goes on once all its sessions have finished, if it holds
exactly `train_group_size` samples (the learner's group size, rollout.samples_per_prompt); otherwise it is
dropped and counted (`groups_wrong_size`: an untrained session or a split episode changes the count;
`groups_untrained`: no session has a reward). A group whose sessions are not all opened within the session
timeout of its first is dropped (`groups_incomplete`), and its key starts a new group; groups still forming are
`groups_open` in the report (at the end of a run: never trained).

A group created for a prompt the controller leased to the worker (an in-process agent's, gateway/agent_runner.py)
carries the lease's group id, so it ends that lease; when it is dropped, its id and reason go to `dropped_groups`
for the worker to report (the controller counts it as any dropped group)."""

import json
import math
import queue
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gateway.chat_render import ChatRenderer
from gateway.episode import SPLIT_REASONS, Episode, HistoryMode
from gateway.episode_samples import episode_samples
from protocols.trajectory import TrajectoryGroup

SESSION_GROUP_PREFIX = "session-group/"
"""Group ids of sessions start with this (the controller admits such a group when it arrives)."""
KEEP_FINISHED_S = 600.0
"""A finished session is remembered this long (a late call or reward is answered 410, not 404), then forgotten."""
COUNTER_NAMES = ("sessions", "sessions_rewarded", "sessions_no_reward", "sessions_lost", "calls", "calls_refused",
                 "calls_lost", "calls_undelivered", "calls_replayed", "calls_busy", "fields_refused",
                 "tool_parse_failures", "clamped_max_tokens", "samples", "retries", "retry_orphans", "staleness_cuts",
                 "groups_opened", "groups", "groups_wrong_size", "groups_untrained", "groups_incomplete",
                 *(f"splits_{r}" for r in SPLIT_REASONS))
"""`counts` keys, all present from the start: sessions opened, trained, finished without reward, lost; calls
served, refused (429), lost (the engine aborted them); calls whose reply reached no client and nothing extended
(dropped from training), retries answered with such a reply, calls refused 409 while another of the session ran;
requests refused for a field (gateway/request_fields.py); replies whose tool calls did not parse; requests whose
max_tokens was lowered; samples handed to training; retried calls and the orphans dropped; calls cut from samples
as too stale; groups opened, handed to training, and dropped for their number of samples, for having no rewarded
session, or for not filling in time; new segments by reason."""


def finite(number: int | float) -> bool:
    """Whether a float holds `number` as a finite value: not inf or NaN, and not an integer past a float's range
    (a client may send 1e400 or a 400-digit integer; the latter makes math.isfinite raise OverflowError)."""
    try:
        return math.isfinite(number)
    except OverflowError:
        return False


class SessionError(Exception):
    """A request the session cannot take: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        """The request field the error is about (OpenAI's `error.param`), if one."""


@dataclass
class Session:
    session_id: str
    api_key: str
    group: "_Group"
    deadline: float
    """time.monotonic() past which the session is finished."""
    episode: Episode
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    lost: bool = False
    calls_in_flight: int = 0
    finished_at: float = 0.0
    attempt: Any = None
    """The session's latest request in the engine (gateway/calls.py `Attempt`): a session's calls are one
    sequence, and a retry of this request is answered with its reply."""


@dataclass
class _Group:
    size: int
    group_id: str
    """Unique over the run: `session-group/<worker>/<serial>/<key>` (a key may be reused once its group went on),
    or a leased group's own id."""
    sessions: list[Session] = field(default_factory=list)
    leased: bool = False
    """Created for a group the controller leased (`create(..., leased=True)`): its drop is reported."""
    fill_by: float = 0.0
    """time.monotonic() by which all its sessions must be opened (its first's deadline); past it, not yet full,
    it is dropped as incomplete."""
    closed: bool = False
    """Went to training or was dropped: it takes no session and is never emitted again."""


class SessionBook:
    def __init__(self, renderer: ChatRenderer, history: HistoryMode, max_sessions: int, timeout_s: float,
                 train_group_size: int = 1, worker_id: int = 0, clock=time.monotonic,
                 records: Path | None = None) -> None:
        self.renderer = renderer
        self.records = records
        """A JSONL file that gets one line per finished session (`record`), trained or not; None: no records."""
        self.train_group_size = train_group_size
        self._anonymous: _Group | None = None
        self._serial = 0
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
        self.dropped_groups: queue.SimpleQueue = queue.SimpleQueue()
        """(group id, reason) of leased groups that did not go on; the rollout worker takes them (`take_dropped`)."""
        self.counts: Counter = Counter({name: 0 for name in COUNTER_NAMES})
        self.min_version: Callable[[], int] | None = None
        """The oldest weight version a token may have been sampled with and still train (the rollout worker's
        version minus train.max_staleness): samples are cut after older calls (episode_samples). None: no cut."""

    @property
    def open_sessions(self) -> int:
        """Sessions created and not finished: each finish counts one of rewarded, no reward, lost. From counters,
        not the session dict, so the worker's thread can read it while the server's loop adds sessions."""
        c = self.counts
        return c["sessions"] - c["sessions_rewarded"] - c["sessions_no_reward"] - c["sessions_lost"]

    @property
    def open_groups(self) -> int:
        """Groups opened and neither trained nor dropped yet: still forming (from counters, as `open_sessions`)."""
        c = self.counts
        return c["groups_opened"] - c["groups"] - c["groups_wrong_size"] - c["groups_untrained"] - \
            c["groups_incomplete"]

    def create(self, group: str | None = None, group_size: int | None = None,
               timeout_s: float | None = None, leased: bool = False) -> Session:
        """A new session in `group` (None: the open anonymous group) of `group_size` sessions (None: the
        learner's group size). `leased` (in-process callers only, never a request): `group` is the id of a group
        the controller leased to this worker, and the group keeps that id."""
        self.sweep()
        if self.open_sessions >= self.max_sessions:
            raise SessionError(429, f"{self.max_sessions} sessions are open (gateway.max_sessions); retry later")
        group_size = self.train_group_size if group_size is None else group_size
        if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= 1024:
            raise SessionError(400, f"group_size={group_size!r}: a group has 1 to 1024 sessions")
        if group is not None and not isinstance(group, str):
            raise SessionError(400, f"group={group!r}: a group key is a string")
        session_id = secrets.token_hex(8)
        key = f"sk-relayrl-{secrets.token_urlsafe(24)}"
        if group is None:
            g = self._anonymous
            if g is None or len(g.sessions) >= g.size or g.size != group_size:
                g = self._anonymous = self._new_group("anonymous", group_size)
        else:
            g = self.groups.get(group) or self._new_group(group, group_size, leased)
        if g.size != group_size or len(g.sessions) >= g.size:
            raise SessionError(409, f"group {group!r} has size {g.size} and {len(g.sessions)} sessions; a group's "
                               "sessions share one group_size and it cannot grow past it")
        timeout = self.timeout_s if timeout_s is None else min(float(timeout_s), self.timeout_s)
        if not g.sessions:
            g.fill_by = self.clock() + self.timeout_s
        session = Session(session_id, key, g, self.clock() + timeout, Episode(self.renderer, self.history))
        g.sessions.append(session)
        self.sessions[session_id] = session
        self.by_key[key] = session
        self.counts["sessions"] += 1
        return session

    def _new_group(self, key: str, size: int, leased: bool = False) -> _Group:
        self._serial += 1
        g = _Group(size, key if leased else f"{SESSION_GROUP_PREFIX}{self.worker_id}/{self._serial}/{key}",
                   leased=leased)
        self.counts["groups_opened"] += 1
        self.groups[g.group_id] = g
        if key != "anonymous":
            self.groups[key] = g
        return g

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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not finite(value):
            raise SessionError(400, f"reward {str(value)[:40]}: send a finite number, or a dict with a number under "
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
        if self.records is not None:
            with open(self.records, "a") as f:
                f.write(json.dumps(self.record(session)) + "\n")
        group = session.group
        if len(group.sessions) == group.size and all(s.finished for s in group.sessions):
            self._emit(group)

    def record(self, session: Session) -> dict:
        """The session as its record: outcome, every call (messages, prompt and sampled ids, log-probs, versions,
        how it joined) and the samples it makes (their calls and loss masks)."""
        calls = [{"index": c.index, "parent": c.plan.parent, "retry_of": c.plan.retry_of,
                  "split_reason": c.plan.split_reason, "messages": list(c.call.messages), "tools": c.call.tools,
                  "template_args": dict(c.call.template_args), "prompt_ids": c.plan.prompt_ids,
                  "sampled_ids": c.sampled_ids, "behavior_logprobs": c.behavior_logprobs,
                  "token_versions": c.token_versions, "finish_reason": c.finish_reason, "reply": c.reply,
                  "delivered": c.delivered, **({"client": c.client} if c.client else {})}
                 for c in session.episode.calls]
        samples, counts = episode_samples(session.episode.calls, f"session/{session.session_id}",
                                          session.group.group_id, session.reward or 0.0,
                                          min_version=self.min_version() if self.min_version is not None else None)
        return {"session_id": session.session_id, "group_id": session.group.group_id, "reward": session.reward,
                "info": session.info, "trained": self.outcome(session)[0],
                "lost": session.lost, "counts": {**session.episode.counts, **counts}, "calls": calls,
                "samples": [{"calls": t.prompt.metadata["calls"], "prompt_tokens": len(t.prompt.prompt_token_ids),
                             "loss_mask": [int(m) for m in t.loss_mask]} for t in samples]}

    @staticmethod
    def outcome(session: Session) -> tuple[bool, str | None]:
        """(whether the session trains, why not): what the routes that end a session answer. Its group may still
        be dropped as a whole once all its sessions finished (counted: groups_wrong_size, groups_incomplete)."""
        if session.lost:
            return False, "the engine aborted one of its calls (answered 503), so its episode is incomplete"
        if session.reward is None:
            return False, "it finished without a reward (POST /sessions/{id}/reward gives one)"
        if not any(c.delivered for c in session.episode.calls):
            return False, "no call's reply reached its client"
        return True, None

    def lose_call(self, session: Session) -> None:
        """A call the engine aborted: its episode is incomplete, so the session is not trained."""
        session.lost = True
        self.counts["calls_lost"] += 1

    def _close(self, group: "_Group") -> None:
        group.closed = True
        if self._anonymous is group:
            self._anonymous = None
        for name in [k for k, g in self.groups.items() if g is group]:
            del self.groups[name]

    def _emit(self, group: "_Group") -> None:
        if group.closed:
            return
        self._close(group)
        trajectories = []
        for s in group.sessions:
            if s.lost or s.reward is None:
                continue
            samples, counts = episode_samples(
                s.episode.calls, f"session/{s.session_id}", group.group_id, s.reward, s.info,
                first_index=len(trajectories), worker_id=self.worker_id, correct=bool(s.info.get("correct", False)),
                min_version=self.min_version() if self.min_version is not None else None)
            trajectories += samples
            self.counts["retry_orphans"] += counts["retry_orphans"]
            self.counts["calls_undelivered"] += counts["calls_undelivered"]
            self.counts["staleness_cuts"] += counts["staleness_cuts"]
        if trajectories and len(trajectories) == self.train_group_size:
            self.counts["samples"] += len(trajectories)
            self.counts["groups"] += 1
            self.finished_groups.put(TrajectoryGroup(group_id=group.group_id, trajectories=trajectories))
            return
        self.counts["groups_wrong_size" if trajectories else "groups_untrained"] += 1
        if group.leased:  # (an untrained session, or samples that do not number the group's size: split episodes)
            untrained = any(s.lost or s.reward is None for s in group.sessions)
            self.dropped_groups.put((group.group_id, "sessions_untrained" if untrained else "group_wrong_size"))

    def sweep(self) -> None:
        """Finish the sessions past their deadline (no calls in flight: a call in flight ends first); drop the
        groups that did not fill in time."""
        now = self.clock()
        for group in {id(g): g for g in self.groups.values()}.values():
            if not group.leased and len(group.sessions) < group.size and now >= group.fill_by:
                self._close(group)
                self.counts["groups_incomplete"] += 1
        for session in list(self.sessions.values()):
            if not session.finished and now >= session.deadline and not session.calls_in_flight:
                self.finish(session)
            elif session.finished and now - session.finished_at > KEEP_FINISHED_S:
                del self.sessions[session.session_id]
                del self.by_key[session.api_key]

    def take_groups(self) -> list[TrajectoryGroup]:
        """Finished groups for training (thread-safe)."""
        return _drain(self.finished_groups)

    def take_dropped(self) -> list[tuple[str, str]]:
        """(group id, reason) of the leased groups dropped since the last call (thread-safe)."""
        return _drain(self.dropped_groups)


def _drain(q: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
