"""The rollout worker: one vLLM engine that streams sampled groups, with behavior log-probs, to the controller.

It drives the engine one decode step at a time (actors/decode_loop.py), so between two steps it can load newer
weights (a safe point): every response token is stamped with the policy version that sampled it, which keeps the
importance correction exact under partial rollouts. Each finished group is put into the object store once, and its
header (protocols/group_header.py) goes to the controller, whose scoring stage has it scored. The worker knows
only the controller. It calls the controller once per batch of groups (`actors/worker_policy.py` decides when), not once per
decode step. Evaluation generation (actors/eval_generation.py) runs on the same engine between runs.
"""

import dataclasses
import logging
import os
import time
import zlib

import ray

from actors import eval_generation
from actors.agent_loop import AgentLoop
from actors.decode_loop import DecodeLoop, SampleInFlight, finish_every_request
from actors.engine_args import engine_args, engine_context, start_failure_hint
from actors.lora_adapter import AdapterRequests, EngineAdapter
from actors.prefix_cache import SaltedRequests, cache_salt
from actors.vllm_weights import check_vllm_interfaces, load_checkpoint_weights, load_object_refs
from actors.weight_probe_requests import ProbingEngine
from actors.worker_policy import PolicySettings, WorkerPolicy
from gateway.sessions import SESSION_GROUP_PREFIX
from learner.rank_setup import require_cuda
from learner.startup_heap import frozen_after_imports
from protocols.config import RunConfig
from protocols.group_header import GroupHeader
from protocols.trajectory import Prompt, TrajectoryGroup
from protocols.weight_announcement import WeightAnnouncement
from protocols.weight_probe import check_probe_fits, run_probe
from rewards.environment import prompt_encoder
from weights.backends import weight_backend

log = logging.getLogger(__name__)


OUTBOX = {"concurrency_groups": {"outbox": 1}}
"""Ray options of a rollout worker actor under a controller: `take_groups` runs in its own thread beside `run`."""


def configure_vllm_env(cfg: RunConfig) -> None:
    """Environment vLLM reads at import: an in-process engine (it lives inside this actor) and, on CPU, the KV
    cache size, since vLLM otherwise reserves most of host RAM."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.rollout.cpu_kvcache_gib))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class RolloutWorker:
    def __init__(self, cfg: RunConfig, worker_id: int, model_path: str, controller=None) -> None:
        configure_vllm_env(cfg)
        with frozen_after_imports():
            from vllm import LLM
            check_vllm_interfaces()  # a vLLM that moved what relayrl calls fails here, naming it, not mid-run

        self.cfg = cfg
        self.worker_id = worker_id
        self.controller = controller
        self.policy = WorkerPolicy(PolicySettings.from_run(cfg), worker_id)
        """The control loop's state (actors/worker_policy.py), and the one owner of the version of the weights in
        this engine (`version`); a new one per `run()` carries that version over (`next_run`)."""
        max_len = engine_context(cfg)
        # at tensor_parallel_size > 1 the GPUs are held by vLLM's Ray workers, not by this actor
        self.on_gpu = require_cuda(cfg.cluster.use_gpus, f"rollout worker {worker_id}",
                                   holds_gpu=cfg.rollout.tensor_parallel_size == 1)
        try:
            self.llm = LLM(**engine_args(cfg, worker_id, model_path))
        except (OSError, ValueError, RuntimeError) as err:
            raise RuntimeError(f"vLLM failed to start rollout worker {worker_id} on model.path={model_path!r}: "
                               f"{err}\n{start_failure_hint(cfg, str(err))}") from err
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self.adapter: EngineAdapter | None = None
        """model.lora: the adapter this engine holds; each weight load replaces it in place."""
        requests = self.engine
        """The engine as the decode loop and the probe add requests to it (with LoRA, each carries the adapter)."""
        if cfg.model.lora.enabled:
            self.adapter = EngineAdapter(self.llm, cfg.model.lora, model_path, worker_id, cfg.model.trust_remote_code)
            requests = AdapterRequests(self.engine, self.adapter)
        self.prefix_cache: SaltedRequests | None = None
        """rollout.prefix_caching: every request salted with the loaded weights' version, and the cache's counts."""
        if cfg.rollout.prefix_caching:
            requests = self.prefix_cache = SaltedRequests(requests, lambda: self.version)
        self.requests = requests
        self.probing: ProbingEngine | None = None
        """The weight-sync check's probe, scored in the engine after each checked version (weight_sync.verify_every)."""
        if cfg.weight_sync.verify_every:
            probe = run_probe(cfg, len(self.tokenizer))
            check_probe_fits(probe, max_len)
            self.probing = ProbingEngine(requests, probe)
        self.skip_on_load: str | None = None
        """Tests only (`inject_weight_fault`): the tensors every later load leaves out (those whose names start with
        it), as a broken transport would."""
        self.agent = AgentLoop(cfg.tools, cfg.reward, self.tokenizer,
                               encode_prompt=prompt_encoder(cfg.data, cfg.tools, self.tokenizer)
                               ) if cfg.tools.enabled else None
        """With tools (cfg.tools): the agent loop, which runs a sample's tool calls beside the engine."""
        self.decoding = DecodeLoop(self.probing or requests, self._sampling_params, cfg.rollout.samples_per_prompt,
                                   cfg.rollout.max_response_tokens, worker_id,
                                   on_request_end=self.agent or finish_every_request,
                                   max_num_seqs=cfg.rollout.max_num_seqs if cfg.rollout.length_aware_dispatch else None)
        """The groups in the engine; with tools, a sample continues after each tool call (`self.agent`)."""
        self.gateway = None
        """gateway.enabled: the session endpoint this worker serves (gateway/service.py), its calls decoded here."""
        if cfg.gateway.enabled:
            from gateway.service import GatewayService

            self.gateway = GatewayService(cfg, self.tokenizer, worker_id, self._call_params)
            # an episode's calls older than train.max_staleness allows are cut from its samples at a call boundary
            self.gateway.book.min_version = lambda: self.version - cfg.train.max_staleness
        self.outbox: dict[str, TrajectoryGroup] = {}
        """Finished groups handed over by header, until the controller takes them (`take_groups`)."""
        self.sync_seconds = 0.0
        self.receiver = weight_backend(cfg).receiver(cfg)
        """The configured transport's receiver (weights/backends.py); a group-forming one is joined later."""

    # --- weights -----------------------------------------------------------------------------------------------
    def join_weight_group(self, info: dict) -> int:
        """Join the weight group as rank `info["rank"]`, for a transport that forms one; every member calls this
        at the same time. A rejoin (after a worker was replaced) leaves the old group first. Returns the rank."""
        self.receiver.join(info)
        return info["rank"]

    def load_weights(self, announcement: WeightAnnouncement) -> float:
        """Load announced weights in place (no engine restart), at a safe point of the caller's choosing: the
        run loop calls it between decode steps. The collective backend may hand over a newer version than the
        one announced (it already arrived); the worker then stamps tokens with that one. Returns seconds spent."""
        if announcement.version <= self.version:
            raise ValueError(f"worker {self.worker_id}: weight version {announcement.version} is not newer than "
                             f"{self.version}")
        start = time.perf_counter()
        refs = self.receiver.direct_refs(announcement) if self.adapter is None else None
        if refs is not None:  # each TP worker maps the version from the object store itself
            version = announcement.version
            load_object_refs(self.llm, version, refs, self.skip_on_load)
        else:
            version = self.receiver.load(announcement, lambda weights: self._apply_weights(weights, announcement))
        self.policy.loaded(version)
        self._probe_weights(version)
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        return seconds

    def _apply_weights(self, weights: list, announcement: WeightAnnouncement) -> None:
        """Load a version's checkpoint-format pairs staged here into the engine: the full weights in place, or
        with LoRA the adapter (replaced in place under the engine's one adapter id)."""
        if self.adapter is not None:
            skip = self.skip_on_load
            self.adapter.load([(name, t) for name, t in weights if skip is None or not name.startswith(skip)])
        else:
            # the version is the announced one, for the workers' report (a collective receiver may stage a newer)
            load_checkpoint_weights(self.llm, weights, announcement.version, self.skip_on_load)

    def _probe_weights(self, version: int) -> None:
        """Score the probe under the weights just loaded, if `version` is checked: in the coming decode steps, or
        now when no rollout is in the engine. A probe of older weights still in flight is dropped."""
        if self.probing is None:
            return
        self.probing.drop()
        if version % self.cfg.weight_sync.verify_every == 0:
            self.probing.start(version)
            if not self.decoding.requests:
                self.probing.finish()

    def weight_probes(self) -> list[dict]:
        """The last probe results {version, digest, logprobs} (also in every report), for the driver between runs."""
        return list(self.probing.results) if self.probing is not None else []

    def inject_weight_fault(self, tensor_name: str | None) -> None:
        """Tests only: leave the tensors whose names start with `tensor_name` out of every later load (a whole
        name: that tensor; an adapter module's prefix: both its matrices; None: load everything again)."""
        self.skip_on_load = tensor_name

    # --- the streaming loop ------------------------------------------------------------------------------------
    def _sampling_params(self, sample: SampleInFlight, max_tokens: int):
        from vllm import SamplingParams

        r = self.cfg.rollout
        # crc32, not hash(): Python salts string hashes per process, which would make runs unrepeatable. A
        # continuation (a later request) draws from its own seed, so a re-issued group still regenerates identically.
        key = f"{self.cfg.train.seed}/{sample.group_id}/{sample.index}"
        if sample.requests_ended:
            key += f"/{sample.requests_ended}"
        return SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=max_tokens, logprobs=0,
                              seed=zlib.crc32(key.encode()) & 0x7FFFFFFF, **eval_generation.tool_stops(self.cfg.tools))

    def _call_params(self, max_tokens: int, options=None):
        """Sampling parameters of an endpoint call: the run's temperature and top_p (the learner's log-probs assume
        them), and the request's stop strings, seed and number of alternative log-probs (`options`, a
        gateway/request_fields.py CallOptions; without a seed a client's retry samples afresh)."""
        from vllm import SamplingParams

        r = self.cfg.rollout
        return SamplingParams(n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=max_tokens,
                              logprobs=(options.top_logprobs or 0) if options else 0,
                              stop=list(options.stop) if options and options.stop else None,
                              seed=options.seed if options else None)

    def _take_sessions(self) -> None:
        """Groups of finished sessions go to the controller as scored groups: the client gave their reward. With
        gateway.agent, leased groups the agent played come back the same way (or dropped, by reason); one the
        worker already reported aborted at a stop is ignored."""
        now = time.monotonic()
        agents = self.gateway.agents
        for group in self.gateway.take_groups():
            if agents is None or group.group_id.startswith(SESSION_GROUP_PREFIX) or agents.claim(group.group_id):
                self.policy.on_scored(group.group_id, self._put(group, rewarded=True), now)
        for group_id, reason in self.gateway.take_dropped():
            if agents is not None and agents.claim(group_id):
                self.policy.on_dropped(reason, [group_id])

    def _in_flight(self) -> int:
        """Leased groups this worker plays: in its engine, or in its agent's sessions (gateway.agent)."""
        agents = self.gateway.agents if self.gateway is not None else None
        return self.decoding.groups_in_flight + (agents.in_flight if agents is not None else 0)

    def _start(self, group_id: str, prompt: Prompt, expected_length: float) -> None:
        """A granted group: into the engine, or to the agent (gateway.agent), which plays it through the endpoint."""
        agents = self.gateway.agents if self.gateway is not None else None
        if agents is not None:
            agents.start(group_id, prompt)
        else:
            self.decoding.start_group(group_id, prompt, expected_length)

    def _put(self, group: TrajectoryGroup, rewarded: bool = False) -> GroupHeader:
        """Keep a finished group in the outbox and return its header, without the tokens, for the controller."""
        self.outbox[group.group_id] = group
        return dataclasses.replace(GroupHeader.of(group, rewarded=rewarded), group=None)

    def take_groups(self, group_ids: list[str]) -> TrajectoryGroup | tuple[TrajectoryGroup, ...]:
        """The outbox's groups, one return each (the controller calls it with num_returns=len(group_ids), in the
        OUTBOX concurrency group, while `run` goes on). The caller owns a task's returns: so the controller owns
        each group, which outlives this worker, while its tokens stay in this node's object store, put once,
        until a reader (a reward worker, a token scorer, the learner) fetches them."""
        groups = tuple(self.outbox.pop(g) for g in group_ids)
        return groups[0] if len(groups) == 1 else groups

    def _check_watch(self) -> None:
        """Read the long poll's answer locally (no controller call) and keep one open."""
        if self._watch is not None and ray.wait([self._watch], timeout=0)[0]:
            self.policy.on_watch(ray.get(self._watch))
            self._watch = None
        if self._watch is None and not self.policy.stopped:
            self._watch = self.controller.watch.remote(self.worker_id, self.policy.loaded_version)

    def _sync(self, stats: dict, start: float) -> None:
        request = self.policy.request(time.monotonic(), self._in_flight(), self._report(stats, start))
        request.outbox = ray.get_runtime_context().current_actor
        self._last_sync = time.monotonic()
        reply = ray.get(self.controller.sync.remote(request))
        for group_id, prompt in self.policy.on_reply(reply):
            self._start(group_id, prompt, reply.expected_lengths.get(group_id, 0.0))

    def run(self) -> dict:
        """Generate until the controller says stop. Returns this worker's counters. The decisions (when to call
        the controller, what to ask, when to load weights) are `WorkerPolicy`'s; this loop carries them out."""
        cfg = self.cfg
        self.policy = self.policy.next_run()
        self._watch = None
        self._last_sync = time.monotonic()
        stats = {"generate_s": 0.0, "idle_s": 0.0, "tokens": 0, "groups": 0, "steps": 0}
        start = time.perf_counter()
        policy, decoding = self.policy, self.decoding
        while True:
            if stats["steps"] % cfg.rollout.weight_sync_interval_steps == 0 or not decoding.active:
                self._check_watch()
            if self.gateway is not None:
                self._take_sessions()
            if policy.sync_due(time.monotonic(), self._in_flight()):
                self._sync(stats, start)
            if policy.stopped:
                break
            newer = policy.weights_to_load(self._in_flight())
            if newer:
                self.load_weights(newer)  # the policy learns the version loaded (maybe newer than announced)
                continue  # ask for work at the new version before the next step
            if self.gateway is not None:
                self.gateway.pump(decoding)  # the endpoint's new calls join the engine; ended ones go back
            if decoding.has_unfinished():
                t0 = time.perf_counter()
                groups = decoding.step(self.version)
                # a step that only waited for tools (the engine had nothing to decode) is idle time
                stats["generate_s" if decoding.decoded else "idle_s"] += time.perf_counter() - t0
                for group in groups:
                    stats["groups"] += 1
                    stats["tokens"] += sum(len(t.response_token_ids) for t in group.trajectories)
                    policy.on_scored(group.group_id, self._put(group), time.monotonic())
            else:
                t0 = time.perf_counter()
                time.sleep(0.003)
                stats["idle_s"] += time.perf_counter() - t0
            stats["steps"] += 1
        # groups the agent plays are cancelled and reported aborted with the engine's (their sessions finish untrained)
        aborted = [*(self.gateway.agents.abort() if self.gateway is not None and self.gateway.agents else []),
                   *decoding.abort()]
        if self.gateway is not None:
            # calls the abort ended fail (503): their sessions are not trained; new calls wait for the next run
            self.gateway.pump(decoding, start_new=False)
            self._take_sessions()
        if self.probing is not None:
            self.probing.finish()  # only the probe is left in the engine: score it, for this report
        report = self._report(stats, start)
        request = policy.final_request(aborted, report)
        request.final, request.outbox = True, ray.get_runtime_context().current_actor
        ray.get(self.controller.sync.remote(request))
        return report

    def _report(self, stats: dict, start: float) -> dict:
        wall = time.perf_counter() - start
        return {**stats, "wall_s": wall, "sync_s": self.sync_seconds, "version": self.version,
                "versions_seen": list(self.policy.versions_seen),
                "weight_probes": self.weight_probes(),
                **(self.prefix_cache.counts if self.prefix_cache is not None else {}),
                **({"tools": self.agent.report()} if self.agent is not None else {}),
                **({"gateway": self.gateway.report()} if self.gateway is not None else {})}

    # --- evaluation and checks (not while `run` is going) --------------------------------------------------------
    def generate_greedy(self, prompts: list[Prompt]) -> list[str]:
        """Greedy responses for held-out evaluation (with tools: each one's final answer, through the agent loop)."""
        if self.agent is not None:
            return [samples[0].final_text for samples in self._agent_responses(prompts, 1, 0.0, 1.0, 0)]
        return eval_generation.greedy_texts(self.llm, prompts, self.cfg.rollout.max_response_tokens,
                                            self._lora_request(), self._cache_salt())

    def generate_eval(self, prompts: list[Prompt], n: int, temperature: float, top_p: float,
                      seed: int) -> list[list[dict]]:
        """`n` responses per prompt for the evaluation harness (see `eval_generation.sample_responses`; with
        tools, `eval_generation.response_row` of each agent-loop response)."""
        if self.agent is not None:
            return [[eval_generation.response_row(t) for t in samples]
                    for samples in self._agent_responses(prompts, n, temperature, top_p, seed)]
        return eval_generation.sample_responses(self.llm, prompts, n, temperature, top_p, seed,
                                                self.cfg.rollout.max_response_tokens, self._lora_request(),
                                                self._cache_salt())

    def _agent_responses(self, prompts: list[Prompt], n: int, temperature: float, top_p: float, seed: int) -> list:
        # an agent loop of its own, so evaluation's tool calls stay out of the training run's counters
        agent = AgentLoop(self.cfg.tools, self.cfg.reward, self.tokenizer, toolbox=self.agent.toolbox,
                          encode_prompt=self.agent.encode_prompt)
        try:
            return eval_generation.agent_responses(self.requests, agent, prompts, n, temperature, top_p, seed,
                                                   self.cfg.rollout.max_response_tokens)
        finally:
            agent.close()

    def sequence_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """log p(response token) under the engine's current weights, for checking that a weight sync is exact."""
        return eval_generation.sequence_logprobs(self.llm, prompt_ids, response_ids, self._lora_request(),
                                                 self._cache_salt())

    def _lora_request(self):
        """The LoRARequest of the adapter this engine holds (None without LoRA), for `LLM.generate`."""
        return self.adapter.request if self.adapter is not None else None

    def _cache_salt(self) -> str | None:
        """The prefix cache's salt for `LLM.generate` under the loaded weights (None: the cache is off)."""
        return cache_salt(self.version) if self.prefix_cache is not None else None

    @property
    def version(self) -> int:
        """The policy version of the weights loaded in this engine: what its tokens are stamped with (the driver
        owns the policy version itself)."""
        return self.policy.loaded_version

    def get_version(self) -> int:
        return self.version
