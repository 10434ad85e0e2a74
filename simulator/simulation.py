"""Scale simulator: the real controller, replay queue and staleness rules, driven on a virtual clock by timed
stand-ins for the vLLM engines and the learner, so hundreds of engines with long-tailed lengths run in seconds.

Real code, called as the Ray actors call it: `RolloutController` (admission budget and fair share, leases,
prompt cursor, `sync`, `watch_news`, `take_batch`, `publish`, `stop`), the `ReplayQueue` inside it (staleness
and zero-variance drops, accounting), the `Prompt` / `Trajectory` / `TrajectoryGroup` records with per-token
`token_versions`, and each worker's `WorkerPolicy` (`actors/worker_policy.py`), the same object
`RolloutWorker.run` consults at every safe point: when to call `sync`, how many groups to ask for, when to load
weights (at once with partial rollouts, after draining otherwise), when to leave. A worker's long poll is
delivered the moment the controller has news for it. The simulator counts controller calls by method; under
`control="legacy"` the policy runs the old per-decode-step loop and the calls it made between two simulated
events (a poll and an acquire per decode step, 333 per second while idle, a stats report per second) are
counted from the steps and the idle time. The learner loop mirrors `Trainer.run`: take a full batch at its
version, train, publish version + 1.
Stand-ins: decode timing (continuous batching; a step costs a + b * running sequences and emits one token per
running sequence; requests beyond max_num_seqs wait FCFS as in vLLM's scheduler; prefill is not modelled),
response lengths (lognormal plus a share that runs to max_response_tokens, as in long chain-of-thought),
rewards (Bernoulli per sample at a per-prompt success rate), reward workers (instant), a weight load (a fixed
pause) and the learner step (c + d * tokens). The driver's long poll for a batch (`wait_batch`) and the worker's
3 ms idle sleep are replaced by reacting at once to the events that can change their answer. With
`SimulatorConfig.tools`, samples are multi-turn (simulator/tools.py): at a tool call a sample leaves its slot
while the tool runs and continues as a new request; tool tokens are in the response but never decoded. With
`SimulatorConfig.length_aware` each worker holds its groups and hands its engine the longest-expected one when the
engine's queue is empty (simulator/dispatch.py), the expectation from the controller's `LengthHistory`.
"""

import gc
import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from actors.controller import RolloutController
from actors.replay_queue import group_has_signal
from actors.worker_policy import PolicySettings, WorkerPolicy, legacy_calls
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup
from protocols.weight_announcement import WeightAnnouncement
from simulator.dispatch import GroupDispatch, PriorityWaiting
from simulator.scenario import (  # noqa: F401  (re-exported: the benchmarks and tests import them from here)
    SimulationResult,
    SimulatorConfig,
    balanced,
    capacities,
    length_hint,
    prompt_lengths,
    response_length,
    success_rates,
)
from simulator.tools import EngineTools, ToolTurns

LEGACY_IDLE_SLEEP_S = 0.003
"""The old worker loop's sleep between controller polls while its engine had nothing to decode."""
LEGACY_STATS_INTERVAL_S = 1.0


class _Sequence:
    __slots__ = ("group", "index", "length", "start_step", "response", "plan", "turn", "versions", "calls",
                 "priority")

    def __init__(self, group: "_Group", index: int, length: int, priority: float = 0.0) -> None:
        self.group, self.index, self.length, self.start_step = group, index, length, -1
        self.priority = priority
        """Under length-aware dispatch, minus its group's expected length: vLLM admits the lowest first."""
        self.response, self.plan = length, None
        """Response tokens (tool tokens included); a multi-turn sample's plan (`ToolTurns._plan_group`)."""


class _Group:
    def __init__(self, group_id: str, prompt: Prompt, lengths: list[int], rewards: list[float],
                 priority: float = 0.0) -> None:
        self.group_id, self.prompt, self.rewards = group_id, prompt, rewards
        self.sequences = [_Sequence(self, i, n, priority) for i, n in enumerate(lengths)]
        self.trajectories: list[Trajectory | None] = [None] * len(lengths)
        self.unfinished = len(lengths)


@dataclass
class _Engine:
    worker_id: int
    policy: WorkerPolicy
    steps: int = 0
    """Decode steps done; tokens of the step with index i (0-based) carry the version in force at i."""
    version_changes: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    running: list = field(default_factory=list)
    """Heap of (finish step, order, sequence)."""
    waiting: deque = field(default_factory=deque)
    active: dict = field(default_factory=dict)
    segment: tuple[float, float, int, int] | None = None
    """(start time, seconds per step, steps at start, steps at end) of the decode run now going."""
    loading: WeightAnnouncement | None = None
    exited: bool = False
    token: int = 0
    timer_at: float = math.inf
    legacy_step_calls: tuple[int, int] = (1, 0)
    """legacy: (polls, acquires) the old loop made per decode step of the current segment."""
    idle_since: float | None = None
    tools: EngineTools = field(default_factory=EngineTools)
    peak_held: int = 0
    """Most sequences the engine was decoding plus samples in a tool call, at any safe point."""


class Simulation(ToolTurns):
    """One run: the real controller, `num_engines` engine stand-ins and a learner stand-in on one event heap."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        self.cfg = cfg
        self.prompt_lengths = prompt_lengths(cfg) if cfg.prompt_length_share > 0 else None
        prompts = [Prompt(prompt_id=f"sim/{i}", prompt_token_ids=[1], metadata={"success_rate": p})
                   for i, p in enumerate(success_rates(cfg))]
        if cfg.length_hints:
            for i, prompt in enumerate(prompts):
                lengths = self.prompt_lengths[i] if self.prompt_lengths else (0.0, cfg.max_length_fraction)
                prompt.metadata["length_hint"] = length_hint(cfg, lengths)
        self.controller = RolloutController(prompts, cfg.prompts_per_step, cfg.max_staleness,
                                            cfg.drop_zero_variance, cfg.seed, num_workers=cfg.num_engines,
                                            clock=lambda: self.now,
                                            length_aware=cfg.length_aware and cfg.length_dispatch != "hold")
        self.legacy = cfg.control == "legacy"
        settings = PolicySettings(prompts_in_flight=cfg.prompts_in_flight,
                                  min_groups_per_request=cfg.min_groups_per_request,
                                  poll_interval_s=cfg.poll_interval_s,
                                  partial_rollouts=cfg.partial_rollouts and cfg.max_staleness > 0,
                                  legacy=self.legacy)
        self.engines = [_Engine(i, WorkerPolicy(settings, i)) for i in range(cfg.num_engines)]
        if cfg.length_aware:
            for e in self.engines:
                e.waiting = PriorityWaiting() if cfg.length_dispatch == "engine" else GroupDispatch()
        self.calls: Counter[str] = Counter()
        self.finished = 0
        self.deciding: _Engine | None = None
        self.events: list = []
        self.order = 0
        self.tokens_of: dict[str, int] = {}
        self.dropped_ids: dict[str, list[str]] = {"zero_variance": [], "aborted_at_stop": []}
        self.queued_ids: set[str] = set()
        self.trained_ids: list[str] = []
        self.learner_version = 0
        self.learner_busy = False
        self.step_ends: list[float] = [0.0]
        self.step_seconds: list[float] = []
        self.step_tokens: list[int] = []
        self.decoded = 0
        self.decoded_at_step: list[int] = [0]
        self.max_lag, self.min_lag = 0, math.inf
        self.stopped = False
        self.now = 0.0
        self.tool_calls, self.tool_seconds = 0, 0.0
        self.pool_sizes: list[int] = []
        self.autoscale_reasons: Counter[str] = Counter()

    # --- event plumbing --------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, *payload) -> None:
        self.order += 1
        heapq.heappush(self.events, (t, self.order, kind, payload))

    def run(self) -> SimulationResult:
        for engine in self.engines:
            if not self.legacy:
                self.calls["watch"] += 1  # each worker opens its long poll
            self._push(0.0, "decide", engine, engine.token, 0)
        self._try_learn(0.0)
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            self.now = now
            if kind == "decide":
                engine, token, steps = payload
                if token == engine.token:
                    self._end_segment(engine, steps)
                    self._decide(engine, now)
            elif kind == "timer":
                engine = payload[0]
                if engine.timer_at == now:
                    engine.timer_at = math.inf
                    self._poke(engine, now)
            elif kind == "synced":
                self._synced(payload[0], now)
            elif kind == "tool":
                self._tool_done(*payload, now)
            elif kind == "learned":
                self._learner_done(now)
            else:  # a subclass's event (simulator/elastic.py)
                getattr(self, f"_on_{kind}")(now, *payload)
        return self._result()

    # --- engines (RolloutWorker.run's loop, its decisions taken by WorkerPolicy) --------------------------------
    def _end_segment(self, e: _Engine, steps: int) -> None:
        if e.segment is not None:
            if self.legacy and steps - e.steps > 1:  # the old loop called the controller at every step between
                polls, acquires = e.legacy_step_calls
                self.calls["poll"] += polls * (steps - e.steps - 1)
                self.calls["acquire"] += acquires * (steps - e.steps - 1)
            self.decoded += (steps - e.steps) * len(e.running)
            e.steps = steps
            e.segment = None
        while e.running and e.running[0][0] <= e.steps:
            seq = heapq.heappop(e.running)[2]
            if seq.plan is None:
                self._finish(e, seq)
            else:
                self._turn_end(e, seq, _stamp(seq.start_step, seq.length, e.version_changes, self.cfg.token_chunk))

    def _decide(self, e: _Engine, now: float) -> None:
        """One pass of the worker loop at a safe point: sync with the controller when the policy says so, leave
        on stop, load newer weights when allowed, then decode."""
        e.token += 1
        p = e.policy
        if e.idle_since is not None:  # legacy: it polled and asked every few milliseconds while idle
            polls = int((now - e.idle_since) / LEGACY_IDLE_SLEEP_S)
            self.calls["poll"] += polls
            self.calls["acquire"] += polls * e.legacy_step_calls[1]
            e.idle_since = None
        self.deciding = e
        if p.sync_due(now, len(e.active)):
            self._sync(e, now)
        self.deciding = None
        if p.stopped:
            self._exit(e, now)
            return
        newer = p.weights_to_load(len(e.active))
        if newer:
            e.loading = newer
            self._push(now + self.cfg.sync_seconds, "synced", e)
            return
        while e.waiting and len(e.running) < self.cfg.max_num_seqs:
            seq = e.waiting.popleft()
            e.tools.continuations_waiting = max(0, e.tools.continuations_waiting - 1)
            seq.start_step = e.steps
            self.order += 1
            heapq.heappush(e.running, (e.steps + seq.length, self.order, seq))
        e.peak_held = max(e.peak_held, len(e.running) + e.tools.in_call)
        e.legacy_step_calls = (1, int(p.want(len(e.active)) > 0))
        if e.running:  # run until the first sequence ends or an event interrupts at a step boundary
            dt = self.cfg.decode_fixed_seconds + self.cfg.decode_seconds_per_seq * len(e.running)
            end = e.running[0][0]
            e.segment = (now, dt, e.steps, end)
            self._push(now + (end - e.steps) * dt, "decide", e, e.token, end)
            deadline = p.deadline()
            if deadline is not None and deadline < now + (end - e.steps) * dt and deadline != e.timer_at:
                e.timer_at = deadline
                self._push(deadline, "timer", e)
        elif self.legacy:
            e.idle_since = now

    def _sync(self, e: _Engine, now: float) -> None:
        request = e.policy.request(now, len(e.active))
        reply = self.controller.sync(request)
        if self.legacy:
            self.calls.update(legacy_calls(request))
        else:
            self.calls["sync"] += 1
        self._received(request.scored, now)
        for group_id, prompt in e.policy.on_reply(reply):
            self._start_group(e, group_id, prompt, -reply.expected_lengths.get(group_id, 0.0))
        self._deliver_news(now)

    def _poke(self, e: _Engine, now: float) -> None:
        """Something the worker waits for happened: it acts on it after its current decode step."""
        if e.exited or e.loading is not None or e is self.deciding:
            return
        if e.segment is None:
            self._push(now, "decide", e, e.token + 1, e.steps)
            e.token += 1
            return
        start, dt, start_steps, end = e.segment
        done = math.ceil((now - start) / dt - 1e-9)
        if start_steps + done < end:
            e.token += 1
            self._push(start + done * dt, "decide", e, e.token, start_steps + done)

    def _deliver_news(self, now: float, engines=None) -> None:
        """Return the long polls that have news (the legacy loop has none: it polls every step instead)."""
        if self.legacy:
            return
        if engines is None:
            engines = [self.engines[w] for w in self.controller.take_woken()]
        for e in engines:
            if e.exited:
                continue
            news = self.controller.watch_news(e.worker_id, e.policy.loaded_version)
            if news is None:
                continue
            e.policy.on_watch(news)
            if not e.policy.stopped:
                self.calls["watch"] += 1  # it opens the next long poll
            self._poke(e, now)

    def _synced(self, e: _Engine, now: float) -> None:
        version = e.loading.version
        if version <= e.policy.loaded_version:
            raise RuntimeError(f"engine {e.worker_id} would load version {version} over {e.policy.loaded_version}")
        e.policy.loaded(version)
        e.loading = None
        e.version_changes.append((e.steps, version))
        self._decide(e, now)

    def _start_group(self, e: _Engine, group_id: str, prompt: Prompt, priority: float = 0.0) -> None:
        rng = random.Random(f"{self.cfg.seed}/{group_id}")
        g = self.cfg.samples_per_prompt
        lengths_of = self.prompt_lengths[int(prompt.prompt_id[4:])] if self.prompt_lengths else None
        lengths = [response_length(rng, self.cfg, lengths_of) for _ in range(g)]
        if self.cfg.length_growth:  # the policy writes longer as it learns: by the version that samples the group
            grown = 1.0 + self.cfg.length_growth * e.policy.loaded_version / self.cfg.steps
            lengths = [min(self.cfg.max_response_tokens, round(n * grown)) for n in lengths]
        rate = prompt.metadata["success_rate"]
        rewards = [1.0 if rng.random() < rate else 0.0 for _ in range(g)]
        group = _Group(group_id, prompt, lengths, rewards, priority)
        if self.cfg.tools is not None:
            self._plan_group(group)
        e.active[group_id] = group
        e.waiting.extend(group.sequences)

    def _finish(self, e: _Engine, seq: _Sequence) -> None:
        group = seq.group
        if seq.plan is None:
            versions = _stamp(seq.start_step, seq.length, e.version_changes, self.cfg.token_chunk)
            logprobs, calls = [-1.0] * len(versions), None
            reason = "length" if seq.length == self.cfg.max_response_tokens else "stop"
        else:
            versions = seq.versions
            logprobs = [-1.0 if v >= 0 else 0.0 for v in versions]
            calls, reason = seq.calls or None, seq.plan.finish_reason
        group.trajectories[seq.index] = Trajectory(
            group_id=group.group_id, sample_index=seq.index, prompt=group.prompt,
            response_token_ids=[1] * len(versions), behavior_logprobs=logprobs, token_versions=versions,
            reward=group.rewards[seq.index], finish_reason=reason, worker_id=e.worker_id, tool_calls=calls)
        group.unfinished -= 1
        if group.unfinished:
            return
        del e.active[group.group_id]
        self.tokens_of[group.group_id] = sum(s.response for s in group.sequences)
        group.sequences = []  # break the group <-> sequence cycle so refcounting frees it
        scored = TrajectoryGroup(group_id=group.group_id, trajectories=group.trajectories)
        e.policy.on_scored(group.group_id, scored, self.now)  # reward workers are instant stand-ins

    def _exit(self, e: _Engine, now: float) -> None:
        e.exited = True
        request = e.policy.final_request(list(e.active))
        self.controller.sync(request)
        if self.legacy:  # the old loop: report_dropped for the aborted, a put per scored, a last stats report
            self.calls.update({k: v for k, v in legacy_calls(request).items() if k != "poll"})
            self.calls["report_worker_stats"] += 1 + int(now / LEGACY_STATS_INTERVAL_S)
        else:
            self.calls["sync"] += 1
        self._received(request.scored, now)
        self.dropped_ids["aborted_at_stop"].extend(e.active)
        e.active.clear()
        e.running.clear()
        e.waiting.clear()

    # --- queue and learner (mirrors Trainer.run) ----------------------------------------------------------------
    def _received(self, scored: list, now: float) -> None:
        """Bookkeeping of the groups a `sync` handed over (the controller already queued or dropped them)."""
        freed = False
        learn = False
        for group_id, group in scored:
            self.finished += 1
            if self.cfg.drop_zero_variance and not group_has_signal(group.rewards):
                self.dropped_ids["zero_variance"].append(group_id)
                freed = True
                continue
            self.queued_ids.add(group_id)
            learn = learn or group.min_version < self.learner_version - self.cfg.max_staleness
        if learn or len(self.controller.queue) >= self.cfg.prompts_per_step:
            self._try_learn(now)
        if freed:
            self._budget_freed(now)

    def _budget_freed(self, now: float) -> None:
        if self.legacy:  # starved legacy workers asked at every step, so they notice at once
            for e in self.engines:
                if e.policy.starved:
                    self._poke(e, now)
        else:
            self._deliver_news(now)

    def _try_learn(self, now: float) -> None:
        if self.learner_busy or self.stopped:
            return
        dropped_before = self.controller.queue.dropped["stale"]
        batch = self.controller.take_batch(self.learner_version)
        if self.controller.queue.dropped["stale"] > dropped_before:
            self._budget_freed(now)
        if batch is None:
            return
        v = self.learner_version
        for group in batch:  # headers: a group's oldest and newest token versions span its samples'
            if group.min_version < v - self.cfg.max_staleness:  # the trainer's own check
                raise RuntimeError(f"the queue returned a sample of version {group.min_version} to learner {v}")
            self.max_lag = max(self.max_lag, v - group.min_version)
            self.min_lag = min(self.min_lag, v - group.max_version)
            self.trained_ids.append(group.group_id)
        tokens = sum(self.tokens_of[g.group_id] for g in batch)
        seconds = self.cfg.learner_fixed_seconds + self.cfg.learner_seconds_per_token * tokens
        self.learner_busy = True
        self.step_seconds.append(seconds)
        self.step_tokens.append(tokens)
        self._push(now + seconds, "learned")

    def _learner_done(self, now: float) -> None:
        self.learner_busy = False
        self.learner_version += 1
        self.controller.publish(WeightAnnouncement(version=self.learner_version))
        self.step_ends.append(now)
        self.decoded_at_step.append(self.decoded)
        if self.learner_version == self.cfg.steps:
            self.controller.stop()
            self.stopped = True
        if self.legacy:  # polled at every step: it notices after its current one
            for e in self.engines:
                self._poke(e, now)
        else:
            self._deliver_news(now, self.engines)
        self._try_learn(now)

    def _result(self) -> SimulationResult:
        cfg, w, n = self.cfg, self.cfg.warmup_steps, self.cfg.steps
        if self.learner_version < n:
            raise RuntimeError(f"the simulation stalled at learner version {self.learner_version} of steps={n}: "
                               f"{self.controller.stats()}")
        window = self.step_ends[n] - self.step_ends[w]
        tokens = sum(self.step_tokens[w:n])
        waiting = [g["group_id"] for g in self.controller.queue.state_dict()["groups"]]
        stale = self.queued_ids - set(self.trained_ids) - set(waiting)
        dropped_ids = {**self.dropped_ids, "stale": sorted(stale, key=lambda g: int(g[1:]))}
        return SimulationResult(
            measured_seconds=window, engine_seconds=self._engine_seconds(self.step_ends[w], self.step_ends[n]),
            pool_sizes=list(self.pool_sizes), autoscale_reasons=dict(self.autoscale_reasons),
            throughput=tokens / window, capacities=capacities(cfg),
            learner_idle_frac=max(0.0, 1 - sum(self.step_seconds[w:n]) / window),  # float noise
            generated_tokens_per_s=(self.decoded_at_step[n] - self.decoded_at_step[w]) / window,
            max_staleness_observed=self.max_lag, min_lag_observed=int(self.min_lag),
            drops=dict(self.controller.queue.dropped), admitted=self.controller.admitted,
            trained_group_ids=list(self.trained_ids), dropped_group_ids=dropped_ids, waiting_group_ids=waiting,
            versions_seen=[e.policy.versions_seen for e in self.engines], sim_seconds=self.step_ends[-1],
            controller_calls=dict(self.calls), finished_groups=self.finished,
            tool_calls=self.tool_calls, tool_seconds=self.tool_seconds,
            driver_calls={k: self.controller.calls[k] for k in ("take_batch", "publish")})


    def _engine_seconds(self, start: float, end: float) -> float:
        """Engine-seconds between `start` and `end`: a fixed pool's engines all run throughout."""
        return self.cfg.num_engines * (end - start)


def _stamp(start: int, length: int, changes: list[tuple[int, int]], chunk: int) -> list[int]:
    """Version of each chunk's first token: token i is sampled in step start + i under the version in force."""
    out: list[int] = []
    chunks = -(-length // chunk)
    for k, (first_step, version) in enumerate(changes):
        until = changes[k + 1][0] if k + 1 < len(changes) else math.inf
        # chunks whose first token's step (start + j * chunk) is before `until`
        below = chunks if until == math.inf else min(chunks, max(0, -(-(until - start) // chunk)))
        out.extend([version] * (below - len(out)))
        if len(out) == chunks:
            break
    return out


def simulate(cfg: SimulatorConfig) -> SimulationResult:
    # The run allocates millions of short-lived acyclic records; generational GC scans cost half the time.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if cfg.autoscale is not None:
            from simulator.elastic import ElasticSimulation

            return ElasticSimulation(cfg).run()
        return Simulation(cfg).run()
    finally:
        if was_enabled:
            gc.enable()
