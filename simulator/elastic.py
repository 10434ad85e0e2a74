"""The elastic rollout pool in simulation: after each learner step the rollout autoscaler's own decision logic
(cluster/autoscaler.py `Autoscaler.decide`, fed what Trainer._autoscale feeds it) resizes the pool of engine
stand-ins, as cluster/rollout_pool.py `resize` does on the real stack:

- grow: new engines start (engine_start_seconds, counted as engine time), then ask the real controller for the
  newest weights and work like any worker; the controller's worker count follows (the fair share at k = 0);
- shrink: the last live engine is retired at the controller (granted nothing more), finishes the groups it holds
  and leaves; past drain_timeout_s its groups still out are released (dropped `rollout_worker_drained`).

With resize_blocks_learner (the driver today) the learner does not train until the resize is done; the wait it
measures for the next step starts after it, as Trainer.run's does. Engine-seconds are counted per engine, from
the moment it was asked for until it left, for throughput per engine-hour.
"""

import math

from actors.worker_policy import WorkerPolicy
from cluster.autoscaler import Autoscaler, StepSignals
from simulator.scenario import SimulatorConfig
from simulator.simulation import Simulation, _Engine


class ElasticSimulation(Simulation):
    """A `Simulation` whose pool the autoscaler resizes between learner steps (cfg.autoscale must be set)."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        super().__init__(cfg)
        self.autoscaler = Autoscaler(cfg.autoscale)
        self.settings = self.engines[0].policy.settings
        self.lifetimes: dict[int, list[float]] = {e.worker_id: [0.0, math.inf] for e in self.engines}
        """worker id -> [asked for at, left at] in simulated seconds."""
        self.starting: set[int] = set()
        self.draining: set[int] = set()
        self.resizing = 0
        """Resize operations (engine starts, drains) the learner waits for (resize_blocks_learner)."""
        self.wait_from = 0.0
        """When the driver began waiting for the next batch: the end of the last step, or of the resize after it."""
        self.batch_at = 0.0
        self.dropped_ids["rollout_worker_drained"] = []

    def live(self) -> list[_Engine]:
        """Engines of the pool: serving or starting, not leaving."""
        return [e for e in self.engines if not e.exited and e.worker_id not in self.draining]

    # --- the learner's side: measure the step, decide, resize ------------------------------------------------
    def _try_learn(self, now: float) -> None:
        if self.resizing:
            return
        busy = self.learner_busy
        super()._try_learn(now)
        if self.learner_busy and not busy:
            self.batch_at = now

    def _learner_done(self, now: float) -> None:
        if self.learner_version + 1 < self.cfg.steps:  # after the last step the run stops; nothing to resize
            signals = StepSignals(wait_s=self.batch_at - self.wait_from, step_s=now - self.wait_from,
                                  queue_depth=len(self.controller.queue), prompts_per_step=self.cfg.prompts_per_step,
                                  dropped_stale=self.controller.queue.dropped["stale"])
            size = len(self.live())
            wanted, reason = self.autoscaler.decide(size, signals)
            self.autoscale_reasons[reason] += 1
            if wanted > size:
                self._grow(wanted - size, now)
            elif wanted < size:
                self._shrink(size - wanted, now)
            self.pool_sizes.append(len(self.live()))
        self.wait_from = now
        super()._learner_done(now)

    def _resized(self, now: float) -> None:
        """One blocking resize operation ended: once none is left, the driver waits for its next batch."""
        if not self.cfg.resize_blocks_learner:
            return
        self.resizing -= 1
        if not self.resizing:
            self.wait_from = now
            self._try_learn(now)

    # --- grow ------------------------------------------------------------------------------------------------
    def _grow(self, count: int, now: float) -> None:
        for _ in range(count):
            worker_id = len(self.engines)  # never used before, as WorkerIds.add gives
            self.engines.append(_Engine(worker_id, WorkerPolicy(self.settings, worker_id)))
            self.lifetimes[worker_id] = [now, math.inf]
            self.starting.add(worker_id)
            self.resizing += self.cfg.resize_blocks_learner
            self._push(now + self.cfg.engine_start_seconds, "started", self.engines[-1])

    def _on_started(self, now: float, e: _Engine) -> None:
        self.starting.discard(e.worker_id)
        self.controller.set_num_workers(len(self.live()))
        if not self.legacy:
            self.calls["watch"] += 1  # it opens its long poll
        if self.stopped:
            e.policy.stopped = True
        self._push(now, "decide", e, e.token, 0)
        self._resized(now)

    # --- shrink ----------------------------------------------------------------------------------------------
    def _shrink(self, count: int, now: float) -> None:
        serving = [e for e in self.live() if e.worker_id not in self.starting]
        for e in serving[-count:]:
            self.controller.retire_worker(e.worker_id)
            self.draining.add(e.worker_id)
            self.resizing += self.cfg.resize_blocks_learner
            self._push(now + self.cfg.drain_timeout_s, "drain_deadline", e)
            self._poke(e, now)  # an idle engine leaves at once
        self.controller.set_num_workers(len(self.live()))

    def _decide(self, e: _Engine, now: float) -> None:
        if e.worker_id in self.draining and not e.exited and not e.active and e.loading is None:
            self._leave(e, now)  # its groups are back: hand over what it holds and stop
            return
        super()._decide(e, now)

    def _leave(self, e: _Engine, now: float) -> None:
        e.token += 1
        request = e.policy.request(math.inf, 0)  # the scored groups it still holds
        self.controller.sync(request)
        self.calls["sync"] += 1
        self._received(request.scored, now)
        self._gone(e, now)

    def _on_drain_deadline(self, now: float, e: _Engine) -> None:
        """rollout.drain_timeout_s passed: what the leaving engine still holds is released and it stops."""
        if e.exited:
            return
        e.token += 1
        released = self.controller.release_worker(e.worker_id, "rollout_worker_drained")
        self.dropped_ids["rollout_worker_drained"].extend(released)
        e.active.clear()
        e.running.clear()
        e.waiting.clear()
        e.segment = None
        self._gone(e, now)
        self._budget_freed(now)

    def _gone(self, e: _Engine, now: float) -> None:
        e.exited = True
        self.lifetimes[e.worker_id][1] = now
        self.controller.release_worker(e.worker_id, "rollout_worker_drained")  # nothing left: ends the id
        self._resized(now)

    def _engine_seconds(self, start: float, end: float) -> float:
        return sum(max(0.0, min(left, end) - max(asked, start)) for asked, left in self.lifetimes.values())


def growing_length_run(**update) -> SimulatorConfig:
    """The long chain-of-thought run of docs/elastic.md: median response 600 tokens at the start, 4x longer by the
    last step (length_growth 3), 2% run to 8192 tokens; 32 groups of 8 per step, max_staleness 4; engines of 32
    sequences (about 1,070 tokens/s each at a full batch); a learner step of 100 s + 1e-4 s per token (its fixed
    part dominates early, so the run needs about twice the engines at the end as at the start); new engines start
    in 30 s. `update`: fields to change (num_engines, autoscale, ...)."""
    cfg = SimulatorConfig(num_engines=2, max_num_seqs=32, prompts_in_flight=16, samples_per_prompt=8,
                          prompts_per_step=32, steps=60, warmup_steps=6, decode_fixed_seconds=0.02,
                          decode_seconds_per_seq=0.0003125, sync_seconds=2.0, learner_fixed_seconds=100.0,
                          learner_seconds_per_token=1e-4, median_response_tokens=600, length_sigma=0.8,
                          max_length_fraction=0.02, max_response_tokens=8192, token_chunk=64, num_prompts=2048,
                          max_staleness=4, length_growth=3.0, engine_start_seconds=30.0)
    return cfg.model_copy(update=update)
