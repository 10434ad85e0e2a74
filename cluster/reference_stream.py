"""Driver side of the reference log-probs: read them off the trajectories (reference workers streamed them) and
turn them into the KL placed in the reward. The learner's in-learner reference (reference.num_workers = 0)
stays behind LearnerGroup.ref_logprobs; both feed the same `reward_kl`.
"""

import torch

from learner.batch import pad_per_token
from learner.objective import kl_for_reward
from protocols.algorithm import AlgorithmConfig
from protocols.trajectory import Trajectory


def streamed_ref_logprobs(trajectories: list[Trajectory]) -> list[list[float]]:
    """Each trajectory's reference log-probs (one per response token), as the reference workers attached them.
    Raises naming the group when one has none: the controller queues a group only with both its reward and its
    reference log-probs, so a missing one is a bug, never something to fill in silently."""
    missing = [t.group_id for t in trajectories if t.ref_logprobs is None]
    if missing:
        raise RuntimeError(
            f"reference.num_workers > 0 but {len(missing)} trajectories reached the learner without ref_logprobs "
            f"(groups {sorted(set(missing))[:5]}); every group should pass a reference worker on its way to the queue")
    return [list(t.ref_logprobs) for t in trajectories]


def reward_kl(behavior_logprobs: list[list[float]], ref_logprobs: list[list[float]], loss_mask: torch.Tensor,
              cfg: AlgorithmConfig) -> torch.Tensor:
    """Per-token KL (N, T) for compute_advantages when the KL is placed in the reward: the estimator
    `algorithm.kl.estimator` of KL(mu || ref) on the sampled tokens, from the behavior log-probs mu (vLLM's, of
    the policy that sampled them) in every off-policy mode; see kl_for_reward for why not the proximal ones."""
    width = loss_mask.shape[1]
    return kl_for_reward(pad_per_token(behavior_logprobs, width), pad_per_token(ref_logprobs, width), loss_mask, cfg)
