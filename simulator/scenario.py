"""The simulator's scenario: its config (engines, batch, staleness, the workload's length and timing models),
the stand-in workload (response lengths, per-prompt success rates, generation and training capacities) and the
result of a run. simulator/simulation.py runs it against the real controller and the workers' own policy.
"""

import functools
import math
import random
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocols.autoscale import AutoscaleConfig
from simulator.tools import ToolScenario, mean_lengths


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

    prompt_length_share: float = Field(0.0, ge=0, le=1)
    """Share of the length spread that belongs to the prompt (as in the long-CoT demo, where `b` in `a*b` sets
    the length): the prompt fixes that share of the log-length variance and of the chance to run to the max
    (`prompt_lengths`). 0: every sample's length is independent of its prompt; 1: all samples of a prompt have
    the same length, and a prompt runs to the max always or never."""

    length_aware: bool = False
    """rollout.length_aware_dispatch: each worker keeps its granted groups and hands its engine the one expected
    longest, whole, whenever the engine's queue is empty (simulator/dispatch.py); the expectation is the
    controller's `LengthHistory` (actors/length_history.py). False: every group's requests join the engine's
    first-come-first-served queue at once."""

    length_dispatch: Literal["worker", "engine", "hold"] = "worker"
    """With length_aware, study only: `engine` gives each request its group's priority in vLLM's `priority`
    scheduling instead of holding groups at the worker (`PriorityWaiting`); `hold` holds them at the worker but
    hands them over in arrival order (no expectation), to separate the hold from the length order."""

    length_hints: bool = False
    """Prompts carry a length hint (metadata `length_hint`: the prompt's own expected length, as a data set may
    compute it from the prompt's text); otherwise the controller predicts from the prompt's earlier samples."""

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

    tools: ToolScenario | None = None
    """Multi-turn samples with tool calls (simulator/tools.py); None: single-turn, as before."""

    length_growth: float = Field(0.0, ge=0, le=100)
    """Response lengths grow over the run, as when a long chain-of-thought policy learns to reason: a group started
    under policy version v has its lengths multiplied by 1 + length_growth * v / steps (capped at
    max_response_tokens). 0: the same length distribution throughout."""

    autoscale: AutoscaleConfig | None = None
    """The rollout autoscaler (rollout.autoscale; cluster/autoscaler.py's own decisions) resizing the pool after
    each learner step, from num_engines within its min_workers..max_workers (simulator/elastic.py). None: a fixed
    pool of num_engines."""

    engine_start_seconds: float = Field(30.0, ge=0)
    """Seconds a new engine takes to start before it asks for weights and work (it counts as an engine
    meanwhile: it holds its GPUs)."""

    drain_timeout_s: float = Field(120.0, gt=0)
    """rollout.drain_timeout_s: a leaving engine's groups still out after this are released (dropped
    `rollout_worker_drained`) and it stops."""

    resize_blocks_learner: bool = True
    """As the driver applies a resize today (cluster/rollout_pool.py): between two steps, waiting for it (a grow
    until the new engines serve, a shrink until the leaving engines drained), so the learner does not train
    meanwhile. False: the resize goes on beside the learner."""

    @model_validator(mode="after")
    def _check(self) -> "SimulatorConfig":
        if self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} leaves no measured step of steps={self.steps}; "
                             f"use warmup_steps < steps")
        if self.tools is not None and (self.length_growth > 0 or self.autoscale is not None):
            raise ValueError("length_growth and autoscale are not modelled with tools; use tools=None")
        if self.autoscale is not None and not (self.autoscale.min_workers <= self.num_engines
                                               <= self.autoscale.max_workers):
            raise ValueError(f"num_engines={self.num_engines} is the autoscaled pool's launch size: it must lie in "
                             f"autoscale.min_workers={self.autoscale.min_workers}..max_workers="
                             f"{self.autoscale.max_workers}")
        if self.tools is not None and self.prompt_length_share > 0:
            raise ValueError(f"prompt_length_share={self.prompt_length_share} is not modelled with tools (their "
                             "capacity draws lengths without prompts); use 0 with tools")
        return self

    def synchronous(self, even_split: bool = True) -> "SimulatorConfig":
        """The synchronous baseline with the same engines, lengths and learner. `even_split` sets
        prompts_in_flight to the engine's share of a batch (the controller's fair share at max_staleness 0 caps
        it there anyway; without it, workers ask for more than they can get)."""
        update = {"max_staleness": 0, "partial_rollouts": False}
        if even_split:
            update["prompts_in_flight"] = -(-self.prompts_per_step // self.num_engines)
        return self.model_copy(update=update)


LENGTH_FIELDS = ("median_response_tokens", "length_sigma", "max_length_fraction", "max_response_tokens", "seed",
                 "prompt_length_share", "num_prompts")


def response_length(rng: random.Random, cfg: SimulatorConfig, prompt: tuple[float, float] | None = None) -> int:
    """One sample's response tokens; `prompt` is its prompt's (log-length offset, chance at max) from
    `prompt_lengths`, None for a prompt without a share (the draws are then as before the prompt share)."""
    offset, at_max = prompt if prompt is not None else (0.0, cfg.max_length_fraction)
    if rng.random() < at_max:
        return cfg.max_response_tokens
    sigma = cfg.length_sigma * math.sqrt(1.0 - cfg.prompt_length_share)
    length = round(cfg.median_response_tokens * math.exp(offset + rng.gauss(0.0, sigma)))
    return max(1, min(cfg.max_response_tokens, length))


@functools.lru_cache(maxsize=16)
def prompt_lengths(cfg: SimulatorConfig) -> tuple[tuple[float, float], ...]:
    """Per prompt, (log-length offset, chance to run to max_response_tokens). With share s the offset is
    N(0, s * sigma^2) (the samples add N(0, (1 - s) * sigma^2), so the spread over all samples is unchanged), and
    the chance at max is (1 - s) * f + s * [the prompt is in the longest f of prompts], so its mean stays f."""
    rng = random.Random(f"{cfg.seed}/prompts/lengths")
    s, f = cfg.prompt_length_share, cfg.max_length_fraction
    out = []
    for _ in range(cfg.num_prompts):
        z = rng.gauss(0.0, 1.0)
        top = 0.5 * (1 + math.erf(z / math.sqrt(2))) > 1 - f
        out.append((cfg.length_sigma * math.sqrt(s) * z, (1 - s) * f + s * float(top)))
    return tuple(out)


def length_hint(cfg: SimulatorConfig, prompt: tuple[float, float]) -> float:
    """A prompt's expected response tokens (its `length_hint`): the chance at max times the max, plus the rest
    times the mean of its lognormal part (capped lengths ignored)."""
    offset, at_max = prompt
    rest = cfg.length_sigma ** 2 * (1.0 - cfg.prompt_length_share) / 2
    mean = cfg.median_response_tokens * math.exp(offset + rest)
    return at_max * cfg.max_response_tokens + (1 - at_max) * min(mean, cfg.max_response_tokens)


def success_rates(cfg: SimulatorConfig) -> list[float]:
    rng = random.Random(f"{cfg.seed}/prompts")
    return [rng.random() for _ in range(cfg.num_prompts)]


@functools.lru_cache(maxsize=64)
def _mean_length(cfg: SimulatorConfig) -> float:
    rng = random.Random(f"{cfg.seed}/capacity")
    if cfg.prompt_length_share == 0:
        return sum(response_length(rng, cfg) for _ in range(100_000)) / 100_000
    prompts = prompt_lengths(cfg)  # the run's own prompts, each equally often
    return sum(response_length(rng, cfg, prompts[rng.randrange(len(prompts))]) for _ in range(100_000)) / 100_000


@functools.lru_cache(maxsize=64)
def _mean_lengths_with_tools(cfg: SimulatorConfig) -> tuple[float, float]:
    return mean_lengths(cfg.tools, functools.partial(response_length, cfg=cfg), cfg.seed, cfg.max_response_tokens)


def capacities(cfg: SimulatorConfig) -> dict[str, float]:
    """The ideal bound: generation capacity (all engines decoding full batches, in response tokens/s) against
    training capacity (learner tokens/s at the mean batch size); throughput can reach at most the smaller.
    Response tokens include tool tokens, which the engines never decode: with tools, the generation capacity is
    the decode capacity times mean response / mean sampled tokens."""
    lengths_only = cfg.model_copy(update={k: v for k, v in SimulatorConfig().model_dump().items()
                                          if k not in (*LENGTH_FIELDS, "tools")})
    if cfg.tools is not None:
        lengths_only = lengths_only.model_copy(update={"tools": cfg.tools.lengths_only()})
    if cfg.tools is None:
        mean_length = mean_generated = _mean_length(lengths_only)
    else:
        mean_generated, mean_length = _mean_lengths_with_tools(lengths_only)
    g = cfg.samples_per_prompt
    keep = 1.0
    if cfg.drop_zero_variance:
        rates = success_rates(cfg)
        keep = sum(1 - p**g - (1 - p) ** g for p in rates) / len(rates)
    s = cfg.max_num_seqs
    decoded = cfg.num_engines * s / (cfg.decode_fixed_seconds + cfg.decode_seconds_per_seq * s)
    generation = decoded * keep if cfg.tools is None else decoded * keep * mean_length / mean_generated
    batch_tokens = cfg.prompts_per_step * g * mean_length
    train = batch_tokens / (cfg.learner_fixed_seconds + cfg.learner_seconds_per_token * batch_tokens)
    return {"mean_length": mean_length, "mean_generated": mean_generated, "keep_fraction": keep,
            "decode_capacity": decoded, "generation_capacity": generation, "training_capacity": train,
            "ideal": min(generation, train)}


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
    """Trained response tokens (tool tokens included) per simulated second over the measured steps."""
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
    tool_calls: int = 0
    """Tool calls that returned during the run (multi-turn scenarios)."""
    tool_seconds: float = 0.0
    """Seconds those calls ran, summed."""
    measured_seconds: float = 0.0
    """Simulated seconds of the measured steps (after warmup_steps)."""
    engine_seconds: float = 0.0
    """Engine-seconds over the measured steps: each engine from the moment it was asked for (starting engines hold
    their GPUs) until it left."""
    pool_sizes: list[int] = field(default_factory=list)
    """The pool's size after each learner step (engines starting included, leaving ones not)."""
    autoscale_reasons: dict[str, int] = field(default_factory=dict)
    """The autoscaler's decisions by reason (cluster/autoscaler.py), over the run."""

    @property
    def tokens_per_engine_hour(self) -> float:
        """Trained response tokens per engine-hour over the measured steps: what the pool's GPUs bought."""
        return self.throughput * self.measured_seconds / self.engine_seconds * 3600

    @property
    def learner_busy_frac(self) -> float:
        return 1.0 - self.learner_idle_frac

    @property
    def fraction_of_ideal(self) -> float:
        return self.throughput / self.capacities["ideal"]
