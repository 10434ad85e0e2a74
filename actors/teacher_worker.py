"""Teacher worker: a Ray actor that holds a frozen teacher model and computes its log-probs of every response
token while groups stream from the rollout workers to the replay queue (on-policy distillation).

It is the reference worker (actors/reference_worker.py) with another model and its own forward budget: the same
scoring code as the learner (dtype, attention kernel, micro-batch planner, chunked head, sampling temperature),
so log pi_teacher and the behavior log-probs mu are on the same scale. The rollout worker's router sends each
group to one teacher worker beside its reward task (Trajectory.teacher_logprobs); tool output tokens are scored
as context but carry no loss, as everywhere. With algorithm.distillation.top_k = k > 0 it also ships its k most
likely ids and their log-probs at every position (Trajectory.teacher_topk_ids, teacher_topk_logprobs), from the
same forward. learner/distillation.py turns the numbers into advantages and the top-k loss.
"""

import json
import time
from pathlib import Path

from actors.reference_worker import ReferenceWorker
from learner.batch_plan import MicroBatching, plan_one_shard
from learner.shard_scoring import score_shard_topk
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch
from protocols.trajectory import TokenScores, TrajectoryGroup


class TeacherWorker(ReferenceWorker):
    role = "teacher"

    @classmethod
    def model_folder(cls, cfg: RunConfig, policy_path: str) -> str:
        return cfg.teacher.path

    @classmethod
    def precheck(cls, cfg: RunConfig, folder: str) -> None:
        """The top-k the learner asks for must exist in the teacher's vocabulary (its config.json)."""
        top_k = cfg.algorithm.distillation.top_k
        vocab = json.loads((Path(folder) / "config.json").read_text()).get("vocab_size")
        if top_k and vocab is not None and top_k > vocab:
            raise ValueError(f"algorithm.distillation.top_k={top_k} exceeds the teacher's vocabulary of {vocab} "
                             f"tokens (teacher.path={folder!r}): set algorithm.distillation.top_k={vocab} or less")

    def __init__(self, cfg: RunConfig, worker_index: int, model_path: str) -> None:
        super().__init__(cfg, worker_index, model_path)
        self.top_k = cfg.algorithm.distillation.top_k
        vocab = self.model.get_output_embeddings().weight.shape[0]
        if self.top_k > vocab:
            raise RuntimeError(f"algorithm.distillation.top_k={self.top_k} exceeds the teacher's vocabulary of "
                               f"{vocab} tokens ({model_path}); set algorithm.distillation.top_k={vocab} or less")

    def score_group(self, group: TrajectoryGroup) -> list[list[float]] | TokenScores:
        """The teacher's log-probs of every trajectory of `group`, in order; with top_k > 0 a TokenScores that adds
        its top-k ids and log-probs at every position (TrajectoryGroup.with_token_scores attaches either)."""
        if not self.top_k:
            return super().score_group(group)
        self._count(groups=1)
        batch = TrainingBatch.from_trajectories(group.trajectories)
        start = time.perf_counter()
        lcfg = self.scoring_cfg.learner
        plan = plan_one_shard(batch, MicroBatching.of_policy(self.scoring_cfg))
        lps, ids, top = score_shard_topk(self.model, batch, plan, self.cfg.rollout.temperature,
                                         lcfg.logits_chunk_tokens, lcfg.packing, self.pad_id, self.device,
                                         self.top_k)
        self._count(micro_batches=len(plan), samples=batch.num_samples, tokens=sum(batch.sample_tokens()),
                    seconds=time.perf_counter() - start)
        lengths = batch.response_lengths.tolist()
        return TokenScores(logprobs=batch.per_sample_rows(lps),
                           topk_ids=[row[:n].tolist() for row, n in zip(ids, lengths)],
                           topk_logprobs=[row[:n].tolist() for row, n in zip(top, lengths)])
