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
3 ms idle sleep are replaced by reacting at once to the events that can change their answer.
"""

import functools
import gc
import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.controller import RolloutController
from actors.replay_queue import group_has_signal
from actors.worker_policy import PolicySettings, WorkerPolicy, legacy_calls
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup, WeightVersion

LEGACY_IDLE_SLEEP_S = 0.003
"""The old worker loop's sleep between controller polls while its engine had nothing to decode."""
LEGACY_STATS_INTERVAL_S = 1.0


class SimulatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_engines: int = Field(64, ge=1, le=4096)
    """Simulated rollout workers, one engine each (rollout.num_workers)."""

    max_num_seqs: int = Field(64, ge=1)
    """Sequences one engine decodes at once (vLLM max_num_seqs); more requests wait in the engine's queue."""

    prompts_in_flight: int = Field(32, ge=1)
    """Groups a worker keeps in its engine (rollout.prompts_in_flight). A group holds its slot until its longest
    sample ends, so prompts_in_flight * samples_per_prompt should exceed max_num_seqs to keep the batch full."""

    samples_per_prompt: int = Field(8, ge=2)
    """Group size G (rollout.samples_per_prompt)."""

    prompts_per_step: int = Field(512, ge=1)
    """Groups per learner batch (learner.prompts_per_step)."""

    max_staleness: int = Field(5, ge=0)
    """train.max_staleness: 0 is the synchronous baseline (generate a batch, train, load weights). With long
    tails it must cover the versions that pass while the longest response decodes, or those groups go stale."""

    partial_rollouts: bool = True
    """train.partial_rollouts: in-flight requests continue under new weights (only with max_staleness > 0)."""

    drop_zero_variance: bool = False
    """Dynamic sampling: the queue drops groups whose rewards are all equal, and their budget is re-admitted."""

    steps: int = Field(24, ge=2, le=10_000)
    """Learner steps to simulate."""

    warmup_steps: int = Field(4, ge=1)
    """Steps left out of the throughput and idle measurement (the pipeline filling up)."""

    decode_fixed_seconds: float = Field(0.02, gt=0)
    """a in a decode step's time a + b * running: reading the weights once per step (memory-bound decode)."""

    decode_seconds_per_seq: float = Field(0.0003125, ge=0)
    """b in a + b * running: each running sequence's KV cache read, in seconds per sequence per step."""

    sync_seconds: float = Field(2.0, ge=0)
    """Pause of one engine per weight load (transfer and in-place reload)."""

    learner_fixed_seconds: float = Field(5.0, ge=0)
    """c in the learner step time c + d * tokens: optimizer step and weight publishing."""

    learner_seconds_per_token: float = Field(1e-5, gt=0)
    """d in c + d * tokens: forward and backward per trained response token (see `balanced`)."""

    median_response_tokens: int = Field(3000, ge=1)
    """Median of the lognormal part of the response length distribution."""

    length_sigma: float = Field(0.8, ge=0, le=4)
    """Log-space spread of the lognormal part; larger means a longer tail. 0 gives a fixed length."""

    max_length_fraction: float = Field(0.05, ge=0, le=1)
    """Share of responses that run to max_response_tokens (long chain-of-thought that does not stop)."""

    max_response_tokens: int = Field(16384, ge=1)
    """Responses stop here (finish_reason `length`)."""

    token_chunk: int = Field(128, ge=1)
    """Simulated tokens per stored token id. Each stored entry carries the version of its chunk's first token,
    so a trajectory's min_version is exact while records stay small; 1 stores every token."""

    num_prompts: int = Field(4096, ge=1)
    """Training prompts, each with a success rate drawn uniformly from [0, 1] for the Bernoulli rewards."""

    seed: int = 0
    """Seeds prompt success rates, response lengths and rewards; the same seed gives the same run."""

    control: Literal["batched", "legacy"] = "batched"
    """How workers reach the controller (`actors/worker_policy.py`): `batched` calls `sync` per batch of groups
    and keeps a long poll for news; `legacy` is the old loop (a poll and an acquire per decode step, a `put` per
    group), kept to measure what it cost."""

    min_groups_per_request: int = Field(4, ge=1)
    """rollout.min_groups_per_request: free slots or scored groups that make a worker call `sync`."""

    poll_interval_s: float = Field(1.0, gt=0)
    """rollout.poll_interval_s: longest a scored group waits at its worker for others to share a call."""

    @model_validator(mode="after")
    def _check(self) -> "SimulatorConfig":
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} leaves no measured step of steps={self.steps}; "
                             f"use warmup_steps < steps")
        return self

    def synchronous(self, even_split: bool = True) -> "SimulatorConfig":
        """The synchronous baseline with the same engines, lengths and learner. `even_split` sets
        prompts_in_flight to the engine's share of a batch (the controller's fair share at max_staleness 0 caps
        it there anyway; without it, workers ask for more than they can get)."""
        update = {"max_staleness": 0, "partial_rollouts": False}
        if even_split:
            update["prompts_in_flight"] = -(-self.prompts_per_step // self.num_engines)
        return self.model_copy(update=update)


LENGTH_FIELDS = ("median_response_tokens", "length_sigma", "max_length_fraction", "max_response_tokens", "seed")


def response_length(rng: random.Random, cfg: SimulatorConfig) -> int:
    if rng.random() < cfg.max_length_fraction:
        return cfg.max_response_tokens
    length = round(cfg.median_response_tokens * math.exp(rng.gauss(0.0, cfg.length_sigma)))
    return max(1, min(cfg.max_response_tokens, length))


def success_rates(cfg: SimulatorConfig) -> list[float]:
    rng = random.Random(f"{cfg.seed}/prompts")
    return [rng.random() for _ in range(cfg.num_prompts)]


@functools.lru_cache(maxsize=64)
def _mean_length(cfg: SimulatorConfig) -> float:
    rng = random.Random(f"{cfg.seed}/capacity")
    return sum(response_length(rng, cfg) for _ in range(100_000)) / 100_000


def capacities(cfg: SimulatorConfig) -> dict[str, float]:
    """The ideal bound: generation capacity (all engines decoding full batches, in trainable tokens/s) against
    training capacity (learner tokens/s at the mean batch size); throughput can reach at most the smaller."""
    lengths_only = cfg.model_copy(update={k: v for k, v in SimulatorConfig().model_dump().items()
                                          if k not in LENGTH_FIELDS})
    mean_length = _mean_length(lengths_only)
    g = cfg.samples_per_prompt
    keep = 1.0
    if cfg.drop_zero_variance:
        rates = success_rates(cfg)
        keep = sum(1 - p**g - (1 - p) ** g for p in rates) / len(rates)
    s = cfg.max_num_seqs
    decoded = cfg.num_engines * s / (cfg.decode_fixed_seconds + cfg.decode_seconds_per_seq * s)
    batch_tokens = cfg.prompts_per_step * g * mean_length
    train = batch_tokens / (cfg.learner_fixed_seconds + cfg.learner_seconds_per_token * batch_tokens)
    return {"mean_length": mean_length, "keep_fraction": keep, "decode_capacity": decoded,
            "generation_capacity": decoded * keep, "training_capacity": train, "ideal": min(decoded * keep, train)}


def balanced(cfg: SimulatorConfig, training_over_generation: float = 1.0) -> SimulatorConfig:
    """`cfg` with learner_seconds_per_token set so training capacity = ratio * generation capacity."""
    cap = capacities(cfg)
    batch_tokens = cfg.prompts_per_step * cfg.samples_per_prompt * cap["mean_length"]
    target = cap["generation_capacity"] * training_over_generation
    per_token = 1.0 / target - cfg.learner_fixed_seconds / batch_tokens
    if per_token <= 0:
        raise ValueError(f"learner_fixed_seconds={cfg.learner_fixed_seconds} alone exceeds the step time of "
                         f"{batch_tokens / target:.1f} s that the target training capacity allows; lower it")
    return cfg.model_copy(update={"learner_seconds_per_token": per_token})


@dataclass
class SimulationResult:
    throughput: float
    """Trained tokens per simulated second over the measured steps."""
    capacities: dict[str, float]
    learner_idle_frac: float
    generated_tokens_per_s: float
    """Decoded tokens per second over the measured steps, whether trained or later dropped."""
    max_staleness_observed: int
    """Largest learner version minus a trained sample's oldest token version."""
    min_lag_observed: int
    """Smallest learner version minus a trained sample's newest token version (0 at k=0: all on-policy)."""
    drops: dict[str, int]
    admitted: int
    trained_group_ids: list[str]
    dropped_group_ids: dict[str, list[str]]
    waiting_group_ids: list[str]
    versions_seen: list[list[int]]
    sim_seconds: float
    controller_calls: dict[str, int]
    """Controller calls made by the rollout workers, by method."""
    driver_calls: dict[str, int]
    """Controller calls made by the learner loop (take_batch, publish), by method."""
    finished_groups: int
    """Groups the workers finished and handed over."""

    @property
    def fraction_of_ideal(self) -> float:
        return self.throughput / self.capacities["ideal"]


class _Sequence:
    __slots__ = ("group", "index", "length", "start_step")

    def __init__(self, group: "_Group", index: int, length: int) -> None:
        self.group, self.index, self.length, self.start_step = group, index, length, -1


class _Group:
    def __init__(self, group_id: str, prompt: Prompt, lengths: list[int], rewards: list[float]) -> None:
        self.group_id, self.prompt, self.rewards = group_id, prompt, rewards
        self.sequences = [_Sequence(self, i, n) for i, n in enumerate(lengths)]
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
    loading: tuple[int, list] | None = None
    exited: bool = False
    token: int = 0
    timer_at: float = math.inf
    legacy_step_calls: tuple[int, int] = (1, 0)
    """legacy: (polls, acquires) the old loop made per decode step of the current segment."""
    idle_since: float | None = None


class Simulation:
    """One run: the real controller, `num_engines` engine stand-ins and a learner stand-in on one event heap."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        self.cfg = cfg
        prompts = [Prompt(prompt_id=f"sim/{i}", prompt_token_ids=[1], metadata={"success_rate": p})
                   for i, p in enumerate(success_rates(cfg))]
        self.controller = RolloutController(prompts, cfg.prompts_per_step, cfg.max_staleness,
                                            cfg.drop_zero_variance, cfg.seed, num_workers=cfg.num_engines,
                                            clock=lambda: self.now)
        self.legacy = cfg.control == "legacy"
        settings = PolicySettings(prompts_in_flight=cfg.prompts_in_flight,
                                  min_groups_per_request=cfg.min_groups_per_request,
                                  poll_interval_s=cfg.poll_interval_s,
                                  partial_rollouts=cfg.partial_rollouts and cfg.max_staleness > 0,
                                  legacy=self.legacy)
        self.engines = [_Engine(i, WorkerPolicy(settings, i)) for i in range(cfg.num_engines)]
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
            else:
                self._learner_done(now, *payload)
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
            self._finish(e, heapq.heappop(e.running)[2])

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
            seq.start_step = e.steps
            self.order += 1
            heapq.heappush(e.running, (e.steps + seq.length, self.order, seq))
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
            self._start_group(e, group_id, prompt)
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
            news = self.controller.watch_news(e.worker_id, e.policy.version)
            if news is None:
                continue
            e.policy.on_watch(news)
            if not e.policy.stopped:
                self.calls["watch"] += 1  # it opens the next long poll
            self._poke(e, now)

    def _synced(self, e: _Engine, now: float) -> None:
        version = e.loading[0]
        if version <= e.policy.version:
            raise RuntimeError(f"engine {e.worker_id} would load version {version} over {e.policy.version}")
        e.policy.loaded(version)
        e.loading = None
        e.version_changes.append((e.steps, version))
        self._decide(e, now)

    def _start_group(self, e: _Engine, group_id: str, prompt: Prompt) -> None:
        rng = random.Random(f"{self.cfg.seed}/{group_id}")
        g = self.cfg.samples_per_prompt
        lengths = [response_length(rng, self.cfg) for _ in range(g)]
        rate = prompt.metadata["success_rate"]
        rewards = [1.0 if rng.random() < rate else 0.0 for _ in range(g)]
        group = _Group(group_id, prompt, lengths, rewards)
        e.active[group_id] = group
        e.waiting.extend(group.sequences)

    def _finish(self, e: _Engine, seq: _Sequence) -> None:
        group, chunk = seq.group, self.cfg.token_chunk
        versions = _stamp(seq.start_step, seq.length, e.version_changes, chunk)
        n = len(versions)
        group.trajectories[seq.index] = Trajectory(
            group_id=group.group_id, sample_index=seq.index, prompt=group.prompt, response_token_ids=[1] * n,
            behavior_logprobs=[-1.0] * n, token_versions=versions, reward=group.rewards[seq.index],
            finish_reason="length" if seq.length == self.cfg.max_response_tokens else "stop",
            worker_id=e.worker_id)
        group.unfinished -= 1
        if group.unfinished:
            return
        del e.active[group.group_id]
        self.tokens_of[group.group_id] = sum(s.length for s in group.sequences)
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
        for group in batch:
            for t in group.trajectories:
                if t.min_version < v - self.cfg.max_staleness:  # the trainer's own check
                    raise RuntimeError(f"the queue returned a sample of version {t.min_version} to learner {v}")
                self.max_lag = max(self.max_lag, v - t.min_version)
                self.min_lag = min(self.min_lag, v - t.max_version)
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
        self.controller.publish(WeightVersion(version=self.learner_version), [])
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
            throughput=tokens / window, capacities=capacities(cfg),
            learner_idle_frac=max(0.0, 1 - sum(self.step_seconds[w:n]) / window),  # float noise
            generated_tokens_per_s=(self.decoded_at_step[n] - self.decoded_at_step[w]) / window,
            max_staleness_observed=self.max_lag, min_lag_observed=int(self.min_lag),
            drops=dict(self.controller.queue.dropped), admitted=self.controller.admitted,
            trained_group_ids=list(self.trained_ids), dropped_group_ids=dropped_ids, waiting_group_ids=waiting,
            versions_seen=[e.policy.versions_seen for e in self.engines], sim_seconds=self.step_ends[-1],
            controller_calls=dict(self.calls), finished_groups=self.finished,
            driver_calls={k: self.controller.calls[k] for k in ("take_batch", "publish")})


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
        return Simulation(cfg).run()
    finally:
        if was_enabled:
            gc.enable()
