"""The critic group: critic.num_workers DeepSpeed value-model ranks as Ray actors (actors/critic_worker.py), a
RankGroup (cluster/rank_group.py) as the policy's learner group is, driven the same way: one plan of shards and
micro-batches (learner/batch_plan.py, with critic.micro_batch_size), every wait within fault.learner_timeout_s, the
ranks' rows merged back by the one merge_rows.

Once per step the driver asks for the batch's values (`values`: GAE's baseline and the value loss's old values,
from the critic as it stands), then trains the ranks together (`start_train` right before the policy learner's
step, `finish` after it, so both run at once) on the GAE returns of the batch. `check_critic_model` refuses a critic folder whose tokenizer or
vocabulary differs from the policy's, before any actor starts.
"""

import logging

import ray

import torch

from actors.critic_worker import CriticWorker
from cluster import checkpoint
from cluster.learner_failure import LearnerRankLost, dead_ranks
from cluster.model_folder import check_same_vocabulary
from cluster.rank_group import RankGroup
from cluster.placement import Placement, gpu_visibility
from learner.batch_plan import MicroBatching, merge_rows, plan_batch
from learner.value_loss import finalize_value_metrics
from protocols.config import RunConfig
from protocols.metrics import combine_metrics
from protocols.training_batch import TrainingBatch

log = logging.getLogger(__name__)

RANK_INVARIANT = ("critic/lr", "critic/version")
"""Critic metrics every rank reports with the same value; the others are sums, counts or `_max` readings."""


def critic_model_path(cfg: RunConfig, policy_path: str) -> str:
    """critic.model_path, or the policy's folder when it is empty (the critic starts from the policy)."""
    return cfg.critic.model_path or policy_path


def check_critic_model(policy_path: str, critic_path: str, trust_remote_code: bool = False) -> None:
    """Raise ValueError naming both folders when the critic's folder is not a Hugging Face model or does not
    share the policy's vocabulary (cluster/model_folder.py check_same_vocabulary): the critic reads the policy's
    token ids, so any difference would silently score other tokens."""
    check_same_vocabulary("critic.model_path", "critic", policy_path, critic_path, trust_remote_code,
                          fix="give a critic folder built on the same tokenizer, or leave critic.model_path empty to "
                              "start from the policy")


def critic_options(cfg: RunConfig, placement: Placement | None, index: int) -> dict:
    """Ray options of critic rank `index`: its bundle of the run's placement, or plain resources (tests)."""
    if placement is not None:
        return placement.options("critic", index)
    c = cfg.critic
    gpus = 1 if cfg.cluster.use_gpus else 0
    return {"num_cpus": c.cpus, "num_gpus": gpus, **({"resources": dict(c.resources)} if c.resources else {}),
            **gpu_visibility(gpus)}


class CriticGroup:
    def __init__(self, cfg: RunConfig, model_path: str, placement: Placement | None = None,
                 join: bool = True) -> None:
        """Start critic.num_workers ranks from `model_path` (see critic_model_path) and join their group
        (join=False: the caller calls `join()`, after starting other actors while these start)."""
        self.cfg = cfg
        self.model_path = model_path
        self.placement = placement
        if cfg.critic.num_workers < 1:
            raise ValueError("CriticGroup needs critic.num_workers >= 1")
        self.version = 0
        """Updates the group has launched, a lost one included: the one count of the critic's version. The ranks
        are told it (train_step, set_version); a restarted group continues from it."""
        self.lost: tuple[int, BaseException] | None = None
        """(rank, error) of a rank found dead during an update; the supervisor restarts the group."""
        self.ranks: list = []
        self._pings: dict = {}
        self._start(None, 0, join)

    def _start(self, module_state, version: int, join: bool = True) -> None:
        """Start every rank in its bundle and join them in a new process group (DeepSpeed engines built), each
        from `module_state` (an object ref of full weights) or the model folder; within fault.worker_start_timeout_s."""
        cfg, n = self.cfg, self.cfg.critic.num_workers
        self.group = RankGroup(CriticWorker, "critic", cfg, self.model_path,
                               [critic_options(cfg, self.placement, r) for r in range(n)],
                               setup_args=(module_state, version), placement=self.placement,
                               start_timeout_s=cfg.fault.worker_start_timeout_s, join=False)
        self.ranks = self.group.ranks
        if join:
            self.join()

    def join(self) -> None:
        """Join the started ranks into their process group (see RankGroup.join)."""
        self.group.join()

    def dead_rank(self) -> tuple[int, BaseException] | None:
        """(rank, error) of a critic rank that died, or None; never blocks (one ping in flight per rank). The
        supervisor calls it while the driver waits for a batch: a dead rank breaks the group's collectives, so
        the whole group is restarted before the next step needs it."""
        if self.lost is not None:
            return self.lost
        if not self._pings:
            self._pings = {rank.ping.remote(): r for r, rank in enumerate(self.ranks)}
        ready, _ = ray.wait(list(self._pings), num_returns=len(self._pings), timeout=0)
        for ref in ready:
            index = self._pings.pop(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                return index, err
        return None

    def restart(self, dead: int) -> str:
        """Replace every rank in the same bundles (a dead rank breaks the group's collectives, so the survivors
        go too) and give the new group the newest weights there are: a surviving rank's (ZeRO-2 keeps the full
        parameters on every rank), else the critic of the run's newest complete checkpoint, else the initial
        weights. The version continues from the newest the group reached (it never goes back: the warm-up of
        the learning rate continues). Every wait is bounded by
        fault.worker_start_timeout_s (a timeout names it). Returns what the weights came from and what was lost,
        for the log."""
        limit = self.cfg.fault.worker_start_timeout_s
        old, self.lost, self._pings = self.ranks, None, {}
        gone = set(dead_ranks(old)) | {dead}
        state_ref, source = None, ""
        for r in [r for r in range(len(old)) if r not in gone]:
            version_ref, ref = old[r].module_state.options(num_returns=2).remote()
            try:
                version = ray.get(version_ref, timeout=limit)
            except (ray.exceptions.RayError, TimeoutError):
                continue  # died too, or stuck: the next survivor, else a checkpoint
            state_ref = ref
            source = (f"the full weights of surviving rank {r} (version {version}); lost: the Adam moments and the "
                      "fp32 master weights' rounding (a rank that died during an update may leave part of it in)")
            break
        folder = None
        if state_ref is None:
            try:
                folder = checkpoint.find_resume_checkpoint(self.cfg.output_dir) / "critic"
            except checkpoint.CheckpointError:
                folder = None
        for rank in old:
            ray.kill(rank)
        self._start(state_ref, self.version)
        if folder is not None and folder.is_dir():
            saved = self.group.gather(self.group.call("load_state", str(folder)), "a checkpoint load",
                                      limit="worker_start_timeout_s")[0]["version"]
            source = (f"the newest checkpoint's critic {folder} (version {saved}, Adam moments included); lost: the "
                      f"{max(self.version - saved, 0)} updates since it")
        elif state_ref is None:
            source = (f"its initial weights {self.model_path}; lost: all {self.version} updates and the Adam "
                      "moments (no rank survived and the run has no checkpoint with a critic)")
        self.group.gather(self.group.call("set_version", self.version), "a restart", limit="worker_start_timeout_s")
        log.warning("critic group restarted after rank %d died; weights from %s; version stays %d", dead, source,
                    self.version)
        return source

    @property
    def workers(self) -> list:
        """The ranks' actor handles (the supervisor's health checks)."""
        return list(self.ranks)

    def _plan(self, batch: TrainingBatch):
        """The policy learner's plan (learner/batch_plan.py) over the critic's ranks, with critic.micro_batch_size:
        shards of about equal tokens whose sample counts differ by one at most, and as many micro-batches on every
        rank (padding ones where a shard needs fewer)."""
        return plan_batch(batch, MicroBatching.of_critic(self.cfg), len(self.ranks))

    def start_train(self, batch: TrainingBatch):
        """Launch one critic update on the batch's returns, with its values as the old values (returns at once;
        `finish` waits). Returns what `finish` needs."""
        mask = batch.loss_mask
        num_tokens = float(mask.sum())
        flat = batch.returns[mask]
        returns_var = float(flat.var(unbiased=False)) if flat.numel() else 0.0
        if num_tokens == 0:  # nothing to fit (every sample masked): no update, the version stays
            return [], returns_var
        # counted when launched: a lost update counts too, so the warm-up of a restarted group goes on in step
        self.version += 1
        refs = self.group.call_sharded("train_step", batch, self._plan(batch), num_tokens, self.version)
        return refs, returns_var

    def finish(self, started) -> dict[str, float]:
        """Wait for the update `start_train` launched, within fault.learner_timeout_s; `critic/*` metrics. A rank
        that died meanwhile loses this update (`critic/update_lost` 1, kept in `lost` for the supervisor, which
        restarts the group); the policy's step goes on. Each failure is looked at as it comes, not after the
        other ranks (they may sit in a collective with the dead one)."""
        refs, returns_var = started
        if not refs:
            return {}
        try:
            parts = self.group.gather(refs, "an update")
        except LearnerRankLost as err:
            self.lost = (err.ranks[0], err.__cause__ or err)
            log.warning("critic rank %d died during an update; the update is lost", err.ranks[0])
            return {"critic/update_lost": 1.0}
        # the learning rate and the version are the same on every rank: rank 0's stand; the rest merge by the rule
        shared = {key: parts[0][key] for key in RANK_INVARIANT if key in parts[0]}
        summed = {**combine_metrics({k: v for k, v in part.items() if k not in RANK_INVARIANT} for part in parts),
                  **shared}
        return finalize_value_metrics(summed, returns_var)

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        return self.finish(self.start_train(batch))

    def values(self, batch: TrainingBatch) -> tuple[torch.Tensor, int]:
        """((B, T) values of every response token, critic version), spread over the ranks by the training plan."""
        plan = self._plan(batch)
        results = self.group.gather(self.group.call_sharded("values", batch, plan), "a values pass")
        return merge_rows(batch, plan, [rows for rows, _ in results]), min(version for _, version in results)

    def save_state(self, folder: str) -> int:
        """Every rank writes its part of a DeepSpeed checkpoint and its RNG states under `folder` (shared by all
        ranks), as the policy's ranks do (learner/rank_checkpoint.py); returns the version."""
        return self.group.gather(self.group.call("save_state", folder), "a checkpoint save")[0]["version"]

    def load_state(self, folder: str) -> int:
        """Every rank loads its part of what save_state wrote (the version and the warm-up's position included)."""
        self.version = self.group.gather(self.group.call("load_state", folder), "a checkpoint load")[0]["version"]
        return self.version

    def save(self, folder: str) -> str:
        return self.group.gather(self.group.call("save", folder), "a model save")[0]

    def shutdown(self) -> None:
        self.group.shutdown()
