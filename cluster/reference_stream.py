"""Driver side of the reference log-probs: check that the trajectories brought them (reference workers streamed
them) and turn the batch's into the KL placed in the reward. The learner's in-learner reference (reference.num_workers = 0)
stays behind LearnerGroup.ref_logprobs; both feed the same `reward_kl`.
"""

import torch

from learner.objective import kl_for_reward
from protocols.algorithm import AlgorithmConfig
from protocols.training_batch import TrainingBatch
from protocols.trajectory import Trajectory


def check_streamed_ref_logprobs(trajectories: list[Trajectory]) -> None:
    """Raise naming the groups when a trajectory reached the driver without reference log-probs: the controller
    queues a group only with both its reward and its reference log-probs, so a missing one is a bug, never
    something to fill in silently."""
    missing = [t.group_id for t in trajectories if t.ref_logprobs is None]
    if missing:
        raise RuntimeError(
            f"reference.num_workers > 0 but {len(missing)} trajectories reached the learner without ref_logprobs "
            f"(groups {sorted(set(missing))[:5]}); every group should pass a reference worker on its way to the queue")


def reward_kl(batch: TrainingBatch, cfg: AlgorithmConfig) -> torch.Tensor:
    """Per-token KL (B, T) for compute_advantages when the KL is placed in the reward: the estimator
    `algorithm.kl.estimator` of KL(mu || ref) on the batch's loss tokens, from the behavior log-probs mu (vLLM's,
    of the policy that sampled them) in every off-policy mode; see kl_for_reward for why not the proximal ones."""
    if batch.ref_logprobs is None:
        raise ValueError("reward_kl needs a batch with ref_logprobs (streamed by reference workers, or scored by "
                         "LearnerGroup.ref_logprobs)")
    return kl_for_reward(batch.behavior_logprobs, batch.ref_logprobs, batch.loss_mask, cfg)
