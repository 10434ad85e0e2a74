"""The run's roles, declared once: the trainer builds, starts and waits for a pool per role in this order, the
supervisor checks them, and the controller's scoring stage is given the live lists of every role that scores
groups.

A new role is a pool class (a `ScoringPool` subclass when its workers score groups on their way to the queue, as
the reward workers below) added to ROLES, plus its config section. A frozen model that scores every response
token (the reference, the teacher) needs no pool class: naming it in protocols.trajectory.TOKEN_SCORERS with its
per-token field gives it a `TokenScoringPool` served by `actors/<role>_worker.py`, and its placement, resources,
metrics and place on the scoring path follow (docs/roles.md). A role whose config asks for no workers has an empty
pool."""

import importlib

from actors.reward_worker import RewardWorker
from cluster.critic_pool import CriticPool
from cluster.model_folder import check_same_vocabulary
from cluster.ray_setup import reward_options, token_scorer_options
from cluster.rollout_pool import RolloutPool
from cluster.worker_pool import PoolContext, ScoringPool, WorkerPool
from protocols.config import RunConfig
from protocols.metrics import reference_worker_metrics, reward_worker_metrics
from protocols.trajectory import TOKEN_SCORERS


class RewardPool(ScoringPool):
    """Reward workers (actors/reward_worker.py): every group is scored by one."""

    name = "reward"
    actor = RewardWorker
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
    .TOKEN_SCORERS): sized by `<name>.num_workers`, its worker class `actors/<name>_worker.py`'s `<Name>Worker`
    (`token_scoring_pool`), and its live list goes to the rollout workers' routers under its name."""

    token_scorer = True

    @classmethod
    def launch_size(cls, cfg: RunConfig) -> int:
        return getattr(cfg, cls.name).num_workers

    @classmethod
    def precheck(cls, cfg: RunConfig, model_path: str) -> None:
        """The role scores the policy's token ids: its model must read them as the same tokens. Then the worker
        class's own refusals (a teacher's top-k within its vocabulary)."""
        if cls.launch_size(cfg):
            folder = cls.actor.model_folder(cfg, model_path)
            check_same_vocabulary(f"{cls.name}.path", cls.name, model_path, folder, cfg.model.trust_remote_code,
                                  fix=f"give {cls.name}.path a model built on the policy's tokenizer (same token -> "
                                      "id map, special tokens and vocab_size)")
            cls.actor.precheck(cfg, folder)

    @classmethod
    def counter_metrics(cls, counters) -> dict[str, float]:
        """`<name>_worker/*`: every frozen scorer keeps the reference worker's counters."""
        return reference_worker_metrics(counters, prefix=f"{cls.name}_worker")

    @classmethod
    def placement_options(cls, cfg: RunConfig, placement, index: int) -> dict:
        """Its bundles of the run's placement, or `<name>.cpus`, `.gpus` and `.resources` past them."""
        return token_scorer_options(cfg, cls.name, placement, index)

    def actor_args(self, index: int) -> tuple:
        """A replacement loads the role's folder again, as at start: a frozen model never changes."""
        return self.cfg, index, self.actor.model_folder(self.cfg, self.ctx.model_path)

    def announce(self):
        return self.ctx.controller.set_model_workers.remote(self.name, list(self.workers))


def token_scoring_pool(role: str) -> type[TokenScoringPool]:
    """The pool of the token scorer `role` of TOKEN_SCORERS, served by `actors/<role>_worker.py`'s `<Role>Worker`
    (a ReferenceWorker subclass naming its model folder): naming the role there is all a new one needs here."""
    worker = f"{role.capitalize()}Worker"
    try:
        actor = getattr(importlib.import_module(f"actors.{role}_worker"), worker)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"protocols.trajectory.TOKEN_SCORERS names the role {role!r}, so actors/{role}_worker.py "
                          f"must define its worker class {worker} ({err}): add it, as actors/teacher_worker.py "
                          "does for the teacher") from err
    return type(f"{role.capitalize()}Pool", (TokenScoringPool,), {"name": role, "actor": actor, "__doc__":
                f"{role}.num_workers > 0: {worker} workers score every response token on the way to the queue."})


TOKEN_SCORING_POOLS: dict[str, type[TokenScoringPool]] = {role: token_scoring_pool(role) for role in TOKEN_SCORERS}
ReferencePool = TOKEN_SCORING_POOLS["reference"]
"""reference.num_workers > 0: the frozen reference scores groups on their way to the queue (the learner ranks then
hold no copy of it); 0 keeps it inside the learner."""
TeacherPool = TOKEN_SCORING_POOLS["teacher"]
"""teacher.num_workers > 0: a frozen teacher scores every sampled token on the way to the queue (on-policy
distillation, learner/distillation.py)."""


ROLES: tuple[type[WorkerPool], ...] = (CriticPool, RewardPool, *TOKEN_SCORING_POOLS.values(), RolloutPool)
"""Start order. The critic's ranks go first (their group is joined right after the learner's started, while the
engines start); the rollout pool last, since its workers are given the others' handles."""


def check_roles(cfg: RunConfig, model_path: str) -> None:
    """Every role's refusals of settings it cannot run, before any actor starts."""
    for role in ROLES:
        role.precheck(cfg, model_path)


def start_pools(ctx: PoolContext) -> dict[str, WorkerPool]:
    """A pool per role, each role's actors started (none waited for); also kept in `ctx.pools`."""
    import ray

    for role in ROLES:
        if role is RolloutPool:  # every scoring worker has a handle now: the stage scores the first group
            ray.get(ctx.controller.set_scoring_workers.remote(ctx.scoring_lists()),
                    timeout=ctx.cfg.fault.worker_start_timeout_s)
        pool = ctx.pools[role.name] = role(ctx)
        pool.start()
    return ctx.pools
