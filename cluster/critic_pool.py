"""The critic pool: PPO's critic group (cluster/critic_group.py) as a worker pool. At each step its ranks value
the batch (`score_batch`: the values of the critic the update starts from, so GAE and the clipped value loss read
the critic as it is, never a stale one) and then train on it beside the learner (`start_update`, `finish_update`).
A dead rank breaks the group's collectives: its replacement is a restart of the whole group (`CriticGroup.restart`
says where the weights come from). With critic.num_workers=0 the pool is empty: it starts, checks and saves nothing.
"""

import logging
import time
from pathlib import Path

from cluster import checkpoint
from cluster.critic_group import CriticGroup, check_critic_model, critic_model_path
from cluster.learner_failure import LearnerRankLost
from cluster.worker_pool import WorkerLost, WorkerPool
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch

log = logging.getLogger(__name__)


class CriticPool(WorkerPool):
    name = "critic"

    @classmethod
    def launch_size(cls, cfg: RunConfig) -> int:
        return cfg.critic.num_workers

    @classmethod
    def precheck(cls, cfg: RunConfig, model_path: str) -> None:
        """PPO's critic reads the policy's token ids: the same tokenizer and vocabulary, checked before any actor."""
        if cfg.critic.enabled:
            check_critic_model(model_path, critic_model_path(cfg, model_path), cfg.model.trust_remote_code)

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.group: CriticGroup | None = None

    def start(self) -> None:
        """The ranks start (their group is joined in `ready`, after the learner's group started meanwhile)."""
        if self.size:
            self.group = CriticGroup(self.cfg, critic_model_path(self.cfg, self.ctx.model_path), self.ctx.placement,
                                     join=False)

    def ready(self) -> None:
        """Join the ranks' group."""
        if self.group is not None:
            self.group.join()

    def handles(self) -> list:
        return self.group.workers if self.group is not None else []

    def writers(self) -> list:
        return self.handles()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()

    def check(self) -> None:
        """A dead critic rank breaks the group's collectives: restart the group before the next step needs it."""
        if self.group is not None:
            lost = self.group.dead_rank()
            if lost is not None:
                self.replace(*lost)

    def ensure_alive(self) -> None:
        self.check()

    def replace(self, index: int, err: BaseException) -> None:
        """Restart the whole critic group (within fault.max_replacements restarts)."""
        cfg, start = self.cfg, time.monotonic()
        log.warning("critic worker %d of critic.num_workers=%d died (%s); restarting the critic group", index,
                    cfg.critic.num_workers, type(err).__name__)
        if self.replaced >= cfg.fault.max_replacements:
            raise WorkerLost(
                f"critic worker {index} of critic.num_workers={cfg.critic.num_workers} died ({type(err).__name__}) "
                f"after {self.replaced} restarts of the critic group; fault.max_replacements="
                f"{cfg.fault.max_replacements} allows no more. Raise it, or look at the worker's log (out of memory: "
                "lower critic.micro_batch_size)") from err
        try:
            self.group.restart(index)
        except TimeoutError as err:
            raise WorkerLost(f"the critic group did not restart after rank {index} died: {err}") from err
        self.replaced += 1
        self.restart_seconds.append(time.monotonic() - start)

    def resize(self, n: int) -> None:
        raise ValueError(f"the critic group does not resize (critic.num_workers={self.cfg.critic.num_workers}): its "
                         "ranks hold one data-parallel model and train together; set critic.num_workers and resume")

    # --- training beside the policy -------------------------------------------------------------------------------
    @property
    def trains(self) -> bool:
        return self.group is not None

    def score_batch(self, batch: TrainingBatch) -> TrainingBatch:
        """The batch with the values of every response token under the critic the update starts from. A rank
        that dies meanwhile restarts the group (the same rule as the health check's, so at most
        fault.max_replacements times) and the values are computed again by the new ranks."""
        while True:
            try:
                values, _ = self.group.values(batch)
                return batch.with_fields(values=values)
            except LearnerRankLost as err:
                self.replace(err.ranks[0], err.__cause__ or err)

    def start_update(self, batch):
        """The critic's update on the batch's GAE returns (learner/prepare.py), while the policy's runs."""
        return self.group.start_train(batch)

    def finish_update(self, started) -> dict[str, float]:
        return self.group.finish(started)

    # --- checkpoints --------------------------------------------------------------------------------------------
    def save_state(self, folder: Path) -> dict:
        """PPO's value model and its optimizer resume with the policy (`critic_version`: the group's update count;
        None without a critic)."""
        if self.group is None:
            return {"critic_version": None}
        (folder / "critic").mkdir()
        return {"critic_version": self.group.save_state(str(folder / "critic"))}

    def load_state(self, folder: Path, state: dict) -> None:
        if self.group is None:
            return
        if state.get("critic_version") is None:
            raise checkpoint.CheckpointError(f"--resume from {folder}: this run has a critic (critic.num_workers="
                                             f"{self.cfg.critic.num_workers}) but the checkpoint holds none")
        self.group.load_state(str(folder / "critic"))

    def save_final(self, run_dir: Path) -> None:
        if self.group is not None:
            self.group.save(str(run_dir / "final_critic"))
