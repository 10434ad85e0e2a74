"""The rollout worker: one vLLM engine that streams sampled groups, with behavior log-probs, to the reward workers.

It drives the engine one decode step at a time, so between two steps it can load newer weights (a safe point):
every response token is stamped with the policy version that sampled it, which keeps the importance
correction exact under partial rollouts. Scored groups go to the controller's replay queue; the worker calls
the controller once per batch of groups (`actors/worker_policy.py` decides when), not once per decode step.
"""

import logging
import os
import time
import zlib

import ray

from actors.stream_join import StreamedGroup
from actors.vllm_weights import load_checkpoint_weights, tensor_parallel_engine_args
from actors.worker_policy import PolicySettings, WorkerPolicy
from learner.weight_backends import weight_backend
from protocols.config import RunConfig
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


def configure_vllm_env(cfg: RunConfig) -> None:
    """Environment vLLM reads at import: an in-process engine (it lives inside this actor) and, on CPU, the KV
    cache size, since vLLM otherwise reserves most of host RAM."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.rollout.cpu_kvcache_gib))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _GroupInFlight:
    def __init__(self, group_id: str, prompt: Prompt, size: int) -> None:
        self.group_id = group_id
        self.prompt = prompt
        self.trajectories: list[Trajectory | None] = [None] * size
        self.token_versions: list[list[int]] = [[] for _ in range(size)]

    @property
    def done(self) -> bool:
        return all(t is not None for t in self.trajectories)


class RolloutWorker:
    def __init__(self, cfg: RunConfig, worker_id: int, model_path: str, controller=None,
                 reward_workers: list | None = None, critic_workers: list | None = None,
                 reference_workers: list | None = None) -> None:
        configure_vllm_env(cfg)
        from vllm import LLM

        self.cfg = cfg
        self.worker_id = worker_id
        self.controller = controller
        self.reward_workers = reward_workers or []
        # PPO: critic workers stamp values on each scored group before it reaches the controller.
        self.critic_workers = critic_workers or []
        self._critic_rr = 0
        self.reference_workers = reference_workers or []
        """reference.num_workers > 0: every group also goes to one of these (round robin) for ref log-probs."""
        self.version = 0
        max_len = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
        self.on_gpu = cfg.cluster.use_gpus
        extra = tensor_parallel_engine_args(cfg.rollout.tensor_parallel_size, self.on_gpu)
        try:
            self.llm = LLM(
                model=model_path,
                dtype=cfg.model.dtype,
                seed=cfg.train.seed + 1000 * worker_id,
                gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                tensor_parallel_size=cfg.rollout.tensor_parallel_size,
                max_model_len=max_len,
                max_num_seqs=cfg.rollout.max_num_seqs,
                enforce_eager=cfg.rollout.enforce_eager,
                # KV computed under old weights must not be reused for new requests after a weight update.
                enable_prefix_caching=False,
                # Behavior log-probs of the distribution actually sampled (after temperature), as the ratio needs.
                logprobs_mode="processed_logprobs",
                trust_remote_code=cfg.model.trust_remote_code,
                **extra,
            )
        except (OSError, ValueError, RuntimeError) as err:
            raise RuntimeError(
                f"vLLM failed to start rollout worker {worker_id} on model.path={model_path!r}: {err}\n"
                "If the path is wrong, fix model.path. If it ran out of memory, lower "
                f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} or "
                f"rollout.cpu_kvcache_gib={cfg.rollout.cpu_kvcache_gib}, or shorten data.max_prompt_tokens + "
                f"rollout.max_response_tokens={max_len}."
            ) from err
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        self._reward_rr = 0
        # Reward workers this worker knows dead (indices into reward_workers) and the list's generation: the
        # controller hands a newer list back with a `sync` reply after the driver replaced one.
        self.reward_generation = 0
        self._dead_reward: set[int] = set()
        self.sent: dict[str, tuple[TrajectoryGroup, int, int, int]] = {}
        """group_id -> (group, reward worker index, re-scoring attempts, list generation) until the controller
        took its score."""
        self._unsent: list[tuple[TrajectoryGroup, int]] = []
        """(group, attempts) waiting for a live reward or reference worker, or the restarted critic group."""
        self.rescore_counts = {"rescored": 0, "dropped_reward_worker_died": 0, "rescored_reference": 0,
                               "dropped_reference_worker_died": 0, "rescored_critic": 0, "dropped_critic_failed": 0}
        self._reference_rr = 0
        # Reference workers known dead and the generation of the reference/critic lists (the controller hands a
        # newer one back after the driver replaced a reference worker or restarted the critic group).
        self.model_generation = 0
        self._dead_reference: set[int] = set()
        self._critic_dead = False
        """A critic worker of the current list died: the driver restarts the whole critic group, so groups wait
        for the new handles instead of meeting the old ranks."""
        self.sent_model: dict[str, tuple[int, int]] = {}
        """group_id -> (reference worker index or -1, reference/critic list generation) until the controller took
        its score."""
        self.versions_seen: list[int] = [0]
        self.sync_seconds = 0.0
        self.receiver = weight_backend(cfg).receiver(cfg)
        """The configured transport's receiver (learner/transport_*.py); a group-forming one is joined later."""

    # --- weights -----------------------------------------------------------------------------------------------
    def join_weight_group(self, info: dict) -> int:
        """Join the weight group as rank `info["rank"]`, for a transport that forms one; every member calls this
        at the same time. A rejoin (after a worker was replaced) leaves the old group first. Returns the rank."""
        self.receiver.join(info)
        return info["rank"]

    def load_weights(self, version: int, refs: list) -> float:
        """Load announced weights in place (no engine restart), at a safe point of the caller's choosing: the
        run loop calls it between decode steps. The collective backend may hand over a newer version than the
        one announced (it already arrived); the worker then stamps tokens with that one. Returns seconds spent."""
        if version <= self.version:
            raise ValueError(f"worker {self.worker_id}: weight version {version} is not newer than {self.version}")
        start = time.perf_counter()
        version = self.receiver.load(version, refs, lambda weights: load_checkpoint_weights(self.llm, weights))
        self.version = version
        self.versions_seen.append(version)
        seconds = time.perf_counter() - start
        self.sync_seconds += seconds
        return seconds

    # --- the streaming loop ------------------------------------------------------------------------------------
    def _sampling_params(self, group_id: str, index: int):
        from vllm import SamplingParams

        r = self.cfg.rollout
        return SamplingParams(
            n=1, temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_response_tokens, logprobs=0,
            # crc32, not hash(): Python salts string hashes per process, which would make runs unrepeatable.
            seed=zlib.crc32(f"{self.cfg.train.seed}/{group_id}/{index}".encode()) & 0x7FFFFFFF,
        )

    def _start_group(self, group_id: str, prompt: Prompt, active: dict, requests: dict) -> None:
        size = self.cfg.rollout.samples_per_prompt
        active[group_id] = _GroupInFlight(group_id, prompt, size)
        for i in range(size):
            request_id = f"{group_id}/{i}"
            requests[request_id] = (group_id, i, 0)
            self.engine.add_request(request_id, {"prompt_token_ids": prompt.prompt_token_ids},
                                    self._sampling_params(group_id, i))

    def _on_output(self, out, active: dict, requests: dict) -> TrajectoryGroup | None:
        group_id, index, seen = requests[out.request_id]
        group = active[group_id]
        completion = out.outputs[0]
        new_tokens = len(completion.token_ids) - seen
        group.token_versions[index].extend([self.version] * new_tokens)
        requests[out.request_id] = (group_id, index, len(completion.token_ids))
        if not out.finished:
            return None
        del requests[out.request_id]
        behavior = [next(iter(d.values())).logprob for d in completion.logprobs]
        group.trajectories[index] = Trajectory(
            group_id=group_id, sample_index=index, prompt=group.prompt,
            response_token_ids=list(completion.token_ids), behavior_logprobs=behavior,
            token_versions=group.token_versions[index], response_text=completion.text,
            finish_reason="length" if completion.finish_reason == "length" else "stop",
            worker_id=self.worker_id,
        )
        if not group.done:
            return None
        del active[group_id]
        return TrajectoryGroup(group_id=group_id, trajectories=group.trajectories)

    def _send_to_reward(self, group: TrajectoryGroup, attempts: int = 0) -> None:
        """Round robin over the reward workers not known dead; with none left the group waits for the list the
        driver sends after replacing them (`_on_reward_news`)."""
        live = [i for i in range(len(self.reward_workers)) if i not in self._dead_reward]
        live_reference = [i for i in range(len(self.reference_workers)) if i not in self._dead_reference]
        critic_down = bool(self.critic_workers) and self._critic_dead
        if not live or (self.reference_workers and not live_reference) or critic_down:
            self._unsent.append((group, attempts))
            return
        index = live[self._reward_rr % len(live)]
        self._reward_rr += 1
        reward_input, streamed, ref_index = group, None, -1
        if self.reference_workers:
            # The reference log-probs are computed beside the reward, not after it: one put, read by both tasks.
            reward_input = ray.put(group)
            ref_index = live_reference[self._reference_rr % len(live_reference)]
            self._reference_rr += 1
            streamed = (self.reference_workers[ref_index].score_group.remote(reward_input), ref_index)
        self.sent_model[group.group_id] = (ref_index, self.model_generation)
        ref = self.reward_workers[index].score_group.remote(reward_input)
        if self.critic_workers:
            # Chained on the unresolved ref: the scored group goes reward worker -> critic -> controller.
            critic = self.critic_workers[self._critic_rr % len(self.critic_workers)]
            self._critic_rr += 1
            ref = critic.add_values.remote(ref)
        self.scoring[ref] = group.group_id
        if streamed is not None:
            self.streamed[ref] = StreamedGroup(ref, *streamed)
        self.sent[group.group_id] = (group, index, attempts, self.reward_generation)

    def _on_reward_news(self, request, reply) -> None:
        """After a `sync`: take the live reward, reference and critic lists if they changed, forget the groups the
        controller took, and send again the ones whose reward, reference or critic worker died (at most
        fault.max_rescore_attempts times; then they are dropped as `reward_worker_died`,
        `reference_worker_died` or `critic_failed`, counted by the controller)."""
        news = False
        if reply.reward_workers is not None:
            self.reward_generation, self.reward_workers = reply.reward_workers[0], list(reply.reward_workers[1])
            self._dead_reward.clear()
            news = True
        if reply.model_workers is not None:
            self.model_generation, lists = reply.model_workers
            self.reference_workers = list(lists.get("reference", self.reference_workers))
            self.critic_workers = list(lists.get("critic", self.critic_workers))
            self._dead_reference.clear()
            self._critic_dead = False
            news = True
        if news:
            unsent, self._unsent = self._unsent, []
            for group, attempts in unsent:
                self._send_to_reward(group, attempts)
        roles = {**{g: "reward" for g in reply.rescore}, **{g: "reference" for g in reply.rescore_reference},
                 **{g: "critic" for g in reply.rescore_critic}}
        for group_id, _ in request.scored:
            entry = self.sent.pop(group_id, None)
            model_entry = self.sent_model.pop(group_id, None)
            role = roles.get(group_id)
            if entry is None or role is None:
                continue
            group, index, attempts, generation = entry
            if role == "reward" and generation == self.reward_generation:  # the index names the dead worker
                self._dead_reward.add(index)
            if role != "reward" and model_entry is not None and model_entry[1] == self.model_generation:
                if role == "reference":
                    self._dead_reference.add(model_entry[0])
                else:
                    self._critic_dead = True
            reason = "critic_failed" if role == "critic" else f"{role}_worker_died"
            if attempts >= self.cfg.fault.max_rescore_attempts:
                self.policy.on_dropped(reason, [group_id])
                self.rescore_counts[f"dropped_{reason}"] += 1
            else:
                # a group whose reference or critic worker died is sent whole again (reward, reference, critic):
                # its reward result was not kept, and scoring it twice costs one verifier call
                self.rescore_counts["rescored" if role == "reward" else f"rescored_{role}"] += 1
                self._send_to_reward(group, attempts + 1)

    def _collect_scored(self, block: bool = False) -> None:
        """Hand the policy the reward tasks that finished, as object refs: the controller resolves them, so the
        data goes reward worker -> controller directly. With reference workers a group is handed over (as a
        StreamedGroup) once its reference task has finished too, so the controller never waits on one.
        `fetch_local=False` keeps ray.wait from pulling them here; a failed task is counted by the controller."""
        if not self.scoring:
            return
        # at stop, scoring still running gets fault.batch_timeout_s; what is left then is dropped by the caller
        refs = [*self.scoring, *(item.ref_logprobs for item in self.streamed.values())]
        ready, _ = ray.wait(refs, num_returns=len(refs),
                            timeout=self.cfg.fault.batch_timeout_s if block else 0, fetch_local=False)
        ready = set(ready)
        now = time.monotonic()
        for ref in [r for r in self.scoring if r in ready]:
            item = self.streamed.get(ref)
            if item is not None and item.ref_logprobs not in ready:
                continue
            self.streamed.pop(ref, None)
            self.policy.on_scored(self.scoring.pop(ref), item or ref, now)

    def _check_watch(self) -> None:
        """Read the long poll's answer locally (no controller call) and keep one open."""
        if self._watch is not None and ray.wait([self._watch], timeout=0)[0]:
            self.policy.on_watch(ray.get(self._watch))
            self._watch = None
        if self._watch is None and not self.policy.stopped:
            self._watch = self.controller.watch.remote(self.worker_id, self.policy.version)

    def _sync(self, stats: dict, start: float) -> None:
        request = self.policy.request(time.monotonic(), len(self.active), self._report(stats, start))
        request.reward_generation = self.reward_generation
        request.model_generation = self.model_generation
        self._last_sync = time.monotonic()
        reply = ray.get(self.controller.sync.remote(request))
        self._on_reward_news(request, reply)
        for group_id, prompt in self.policy.on_reply(reply):
            self._start_group(group_id, prompt, self.active, self.requests)

    def run(self) -> dict:
        """Generate until the controller says stop. Returns this worker's counters. The decisions (when to call
        the controller, what to ask, when to load weights) are `WorkerPolicy`'s; this loop carries them out."""
        cfg = self.cfg
        self.policy = WorkerPolicy(PolicySettings.from_run(cfg), self.worker_id, self.version)
        self.active: dict[str, _GroupInFlight] = {}
        self.requests: dict[str, tuple[str, int, int]] = {}
        self.scoring: dict = {}  # reward task ref -> group_id
        self.streamed: dict = {}  # reward task ref -> StreamedGroup (reference workers on)
        self._watch = None
        self._last_sync = time.monotonic()
        stats = {"generate_s": 0.0, "idle_s": 0.0, "tokens": 0, "groups": 0, "steps": 0}
        start = time.perf_counter()
        policy = self.policy
        while True:
            if stats["steps"] % cfg.rollout.weight_sync_interval_steps == 0 or not self.active:
                self._check_watch()
            self._collect_scored()
            now = time.monotonic()
            # groups waiting for a live reward, reference or critic worker: ask every fault.health_check_s for the
            # new lists (a worker starved of budget would otherwise never call, and its groups would wait forever)
            if policy.sync_due(now, len(self.active)) or (
                    self._unsent and now - self._last_sync >= cfg.fault.health_check_s):
                self._sync(stats, start)
            if policy.stopped:
                break
            newer = policy.weights_to_load(len(self.active))
            if newer:
                self.load_weights(*newer)
                # the collective backend may have handed over a newer version than the one announced
                policy.loaded(self.version)
                continue  # ask for work at the new version before the next step
            if self.engine.has_unfinished_requests():
                t0 = time.perf_counter()
                outputs = self.engine.step()
                stats["generate_s"] += time.perf_counter() - t0
                for out in outputs:
                    group = self._on_output(out, self.active, self.requests)
                    if group is not None:
                        stats["groups"] += 1
                        stats["tokens"] += sum(len(t.response_token_ids) for t in group.trajectories)
                        self._send_to_reward(group)
            else:
                t0 = time.perf_counter()
                time.sleep(0.003)
                stats["idle_s"] += time.perf_counter() - t0
            stats["steps"] += 1
        if self.requests:
            self.engine.abort_request(list(self.requests))
            self.requests.clear()
        self._collect_scored(block=True)
        # groups still waiting for a live reward, reference or critic worker, or whose scoring did not end in time,
        # are dropped
        waiting_for = ("reward_worker_died" if len(self._dead_reward) == len(self.reward_workers) else
                       "critic_failed" if self._critic_dead else "reference_worker_died")
        self.policy.on_dropped(waiting_for, [g.group_id for g, _ in self._unsent])
        self.policy.on_dropped("reward_timeout", list(self.scoring.values()))
        self._unsent, self.scoring = [], {}
        report = self._report(stats, start)
        request = self.policy.final_request(list(self.active), report)
        request.reward_generation, request.final = self.reward_generation, True
        request.model_generation = self.model_generation
        ray.get(self.controller.sync.remote(request))
        self.active.clear()
        self.sent.clear()
        self.sent_model.clear()
        return report

    def _report(self, stats: dict, start: float) -> dict:
        wall = time.perf_counter() - start
        return {**stats, "wall_s": wall, "sync_s": self.sync_seconds, "version": self.version,
                "versions_seen": list(self.versions_seen), **self.rescore_counts}

    # --- evaluation and checks -----------------------------------------------------------------------------------
    def generate_greedy(self, prompts: list[Prompt]) -> list[str]:
        """Greedy responses for held-out evaluation (not while `run` is going)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=self.cfg.rollout.max_response_tokens)
        outs = self.llm.generate([{"prompt_token_ids": p.prompt_token_ids} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    def generate_eval(self, prompts: list[Prompt], n: int, temperature: float, top_p: float,
                      seed: int) -> list[list[dict]]:
        """`n` responses per prompt for the evaluation harness (not while `run` is going): temperature 0 is
        greedy. Each prompt's sampling is seeded from `seed` and its prompt id, so the draws do not depend on how
        the prompts were split over workers. Per prompt, per response: text, tokens, finish_reason."""
        from vllm import SamplingParams

        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                                 max_tokens=self.cfg.rollout.max_response_tokens,
                                 seed=zlib.crc32(f"eval/{seed}/{p.prompt_id}".encode()) & 0x7FFFFFFF)
                  for p in prompts]
        outs = self.llm.generate([{"prompt_token_ids": p.prompt_token_ids} for p in prompts], params,
                                 use_tqdm=False)
        return [[{"text": o.text, "tokens": len(o.token_ids),
                  "finish_reason": "length" if o.finish_reason == "length" else "stop"} for o in out.outputs]
                for out in outs]

    def sequence_logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """log p(response token) under the engine's current weights at temperature 1 (prompt log-probs are
        computed from raw logits), for checking that a weight sync is exact."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
        inputs = [{"prompt_token_ids": p + r} for p, r in zip(prompt_ids, response_ids)]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out, p, r in zip(outs, prompt_ids, response_ids):
            lps = out.prompt_logprobs[len(p):len(p) + len(r)]
            result.append([lp[tok].logprob for lp, tok in zip(lps, r)])
        return result

    def get_version(self) -> int:
        return self.version
