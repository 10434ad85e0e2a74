"""Reference worker: a Ray actor that holds the frozen reference policy (the initial model) and computes the
reference log-probs of each response token while groups stream from the rollout workers to the replay queue.

A rollout worker sends every finished group to a reward worker and, at the same time, to a reference worker
(round robin); the controller joins the two results before it queues the group, so the learner never waits for
reference scoring and holds no reference copy. Sharding is plain data parallel: each worker holds the whole
model and scores whole groups on its own (no collectives, so any worker takes any group; a model too large
for one device would need ZeRO-3 inference, whose forwards are collectives every worker must join together).
Scoring is the learner's own code (learner/shard_scoring.py): the same dtype, attention kernel, micro-batch
planner, chunked LM head and temperature as the in-learner reference, so the numbers are the same. Only the
forward's size may differ (reference.max_tokens_per_micro_batch): the worker runs no backward.
"""

import time
from typing import Any

import torch

from learner.batch_plan import MicroBatching, plan_one_shard
from learner.rank_setup import attention_implementation, require_cuda
from learner.shard_scoring import score_shard
from learner.startup_heap import frozen_after_imports
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch
from protocols.trajectory import TrajectoryGroup


COUNTERS = ("groups", "samples", "tokens", "micro_batches", "seconds")
"""What a reference worker counts: groups and samples scored, tokens through the model (prompt + response),
forwards, and seconds spent scoring."""


class ReferenceWorker:
    role = "reference"
    """The config section and the name in errors; a teacher worker (actors/teacher_worker.py) is this class with
    its own model and budget."""

    @classmethod
    def model_folder(cls, cfg: RunConfig, policy_path: str) -> str:
        """The folder this role's frozen model loads from: the reference is the policy as it starts."""
        return policy_path

    @classmethod
    def precheck(cls, cfg: RunConfig, folder: str) -> None:
        """Refuse settings this role cannot run, before any actor starts (the pool has already checked that
        `folder` reads the policy's token ids as the same tokens)."""

    def __init__(self, cfg: RunConfig, worker_index: int, model_path: str) -> None:
        with frozen_after_imports():
            from transformers import AutoModelForCausalLM

        self.cfg = cfg
        self.worker_index = worker_index
        use_cuda = require_cuda(cfg.cluster.use_gpus, f"{self.role} worker {worker_index}")
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        # model.dtype names a torch dtype ("float32", "bfloat16", "float16"), loaded as the learner loads it.
        dtype = getattr(torch, cfg.model.dtype)
        attn = attention_implementation(use_cuda, cfg.learner.packing, dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attn,
                                                         trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError) as err:
            setting = "model.path" if self.role == "reference" else f"{self.role}.path"
            raise RuntimeError(f"{self.role} worker {worker_index} could not load {setting}={model_path!r}: {err}") \
                from err
        self.model = model.eval().requires_grad_(False).to(self.device)
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.totals = dict.fromkeys(COUNTERS, 0.0)
        self.since = dict.fromkeys(COUNTERS, 0.0)
        """The same counts since the last `counters()` call (the driver's per-step log)."""
        budget = getattr(cfg, self.role).max_tokens_per_micro_batch
        self.scoring_cfg = cfg if budget == 0 else cfg.model_copy(
            update={"learner": cfg.learner.model_copy(update={"max_tokens_per_micro_batch": budget})})
        """The run's config with the role's own forward budget in the learner's place: score_shard plans
        micro-batches from learner.*."""

    def score_batch(self, batch: TrainingBatch) -> list[list[float]]:
        """The frozen model's log-probs of each response token the engine sampled (0 on others), per sample."""
        start = time.perf_counter()
        lcfg = self.scoring_cfg.learner
        plan = plan_one_shard(batch, MicroBatching.of_policy(self.scoring_cfg))
        out = score_shard(self.model, batch, plan, self.cfg.rollout.temperature, lcfg.logits_chunk_tokens,
                          lcfg.packing, self.pad_id, self.device)
        self._count(micro_batches=len(plan), samples=batch.num_samples, tokens=sum(batch.sample_tokens()),
                    seconds=time.perf_counter() - start)
        return batch.per_sample_rows(out)

    def _count(self, **amounts: float) -> None:
        for name, amount in amounts.items():
            self.totals[name] += amount
            self.since[name] += amount

    def score_group(self, group: TrajectoryGroup) -> list[list[float]]:
        """The frozen model's log-probs of every trajectory of `group`, in order (TrajectoryGroup
        .with_token_scores attaches them). Returns lists, not the group: only the new numbers travel back."""
        self._count(groups=1)
        return self.score_batch(TrainingBatch.from_trajectories(group.trajectories))

    def score_rows(self, *groups: TrajectoryGroup) -> tuple:
        """`score_group` of each of a batch's groups as the scoring stage calls it, with one return more than there
        are groups: the row counts (small: the stage awaits them), then each group's rows (left in the object
        store until the learner reads them)."""
        return [len(g.trajectories) for g in groups], *(self.score_group(g) for g in groups)

    def stats(self) -> dict[str, float]:
        """COUNTERS since start."""
        return dict(self.totals)

    def counters(self) -> dict[str, float]:
        """COUNTERS since the last call, then reset; the driver merges several workers' with
        protocols.metrics.reference_worker_metrics."""
        out, self.since = self.since, dict.fromkeys(COUNTERS, 0.0)
        return out

    def ping(self) -> int:
        return self.worker_index
