"""The run's roles, declared once: the trainer builds, starts and waits for a pool per role in this order, the
supervisor checks them, and the rollout workers are given the live lists of every role that scores groups.

A new role is a pool class (a `ScoringPool` subclass when its workers score groups on their way to the queue, as
the reward and reference workers below) added to ROLES, plus its config section. A frozen model that scores every
response token (a `TokenScoringPool`, as the reference and the teacher) is also named in
protocols.trajectory.TOKEN_SCORERS with its per-token field, from which its placement, its resources, its metrics
and its place on the scoring path follow. A role whose config asks for no workers has an empty pool.
"""

import json
from pathlib import Path

from actors.reference_worker import ReferenceWorker
from actors.reward_worker import RewardWorker
from actors.teacher_worker import TeacherWorker
from cluster.critic_pool import CriticPool
from cluster.model_folder import check_same_vocabulary
from cluster.ray_setup import reward_options, token_scorer_options
from cluster.rollout_pool import RolloutPool
from cluster.worker_pool import PoolContext, ScoringPool, WorkerPool
from protocols.config import RunConfig
from protocols.metrics import reference_worker_metrics, reward_worker_metrics


class RewardPool(ScoringPool):
    """Reward workers (actors/reward_worker.py): every group is scored by one."""

    name = "reward"
    actor = RewardWorker
    rollout_arg = "reward_workers"
    counter_metrics = staticmethod(reward_worker_metrics)
    placement_options = staticmethod(reward_options)

    @classmethod
    def launch_size(cls, cfg: RunConfig) -> int:
        return cfg.reward.num_workers

    def actor_args(self, index: int) -> tuple:
        return self.cfg.reward, index

    def announce(self):
        return self.ctx.controller.set_reward_workers.remote(list(self.workers))


class TokenScoringPool(ScoringPool):
    """A frozen model whose workers score every response token in the stream (protocols.trajectory
    .TOKEN_SCORERS): sized by `<name>.num_workers`, and its live list goes to the rollout workers' routers under
    its name."""

    token_scorer = True

    @classmethod
    def launch_size(cls, cfg: RunConfig) -> int:
        return getattr(cfg, cls.name).num_workers

    @classmethod
    def counter_metrics(cls, counters) -> dict[str, float]:
        """`<name>_worker/*`: every frozen scorer keeps the reference worker's counters."""
        return reference_worker_metrics(counters, prefix=f"{cls.name}_worker")

    @classmethod
    def placement_options(cls, cfg: RunConfig, placement, index: int) -> dict:
        """Its bundles of the run's placement, or `<name>.cpus`, `.gpus` and `.resources` past them."""
        return token_scorer_options(cfg, cls.name, placement, index)

    def announce(self):
        return self.ctx.controller.set_model_workers.remote(self.name, list(self.workers))


class ReferencePool(TokenScoringPool):
    """reference.num_workers > 0: the frozen reference scores groups on their way to the queue (the learner ranks
    then hold no copy of it); 0 keeps it inside the learner. A replacement loads it from the model folder again
    (as at start: it never changes)."""

    name = "reference"
    actor = ReferenceWorker

    def actor_args(self, index: int) -> tuple:
        return self.cfg, index, self.ctx.model_path


class TeacherPool(TokenScoringPool):
    """teacher.num_workers > 0: a frozen teacher scores every sampled token on the way to the queue (on-policy
    distillation, learner/distillation.py). A replacement loads the teacher's folder again."""

    name = "teacher"
    actor = TeacherWorker

    @classmethod
    def precheck(cls, cfg: RunConfig, model_path: str) -> None:
        """The teacher scores the student's token ids: it must read them as the same tokens."""
        if cfg.teacher.enabled:
            check_same_vocabulary("teacher.path", "teacher", model_path, cfg.teacher.path,
                                  cfg.model.trust_remote_code,
                                  fix="distill from a teacher built on the student's tokenizer (same token -> id map, "
                                      "special tokens and vocab_size)")
            top_k = cfg.algorithm.distillation.top_k
            vocab = json.loads((Path(cfg.teacher.path) / "config.json").read_text()).get("vocab_size")
            if top_k and vocab is not None and top_k > vocab:
                raise ValueError(f"algorithm.distillation.top_k={top_k} exceeds the teacher's vocabulary of {vocab} "
                                 f"tokens (teacher.path={cfg.teacher.path!r}): set algorithm.distillation.top_k="
                                 f"{vocab} or less")

    def actor_args(self, index: int) -> tuple:
        return self.cfg, index, self.cfg.teacher.path


ROLES: tuple[type[WorkerPool], ...] = (CriticPool, RewardPool, ReferencePool, TeacherPool, RolloutPool)
"""Start order. The critic's ranks go first (their group is joined right after the learner's started, while the
engines start); the rollout pool last, since its workers are given the others' handles."""


def check_roles(cfg: RunConfig, model_path: str) -> None:
    """Every role's refusals of settings it cannot run, before any actor starts."""
    for role in ROLES:
        role.precheck(cfg, model_path)


def start_pools(ctx: PoolContext) -> dict[str, WorkerPool]:
    """A pool per role, each role's actors started (none waited for); also kept in `ctx.pools`."""
    for role in ROLES:
        pool = ctx.pools[role.name] = role(ctx)
        pool.start()
    return ctx.pools
