"""The reward worker as a real Ray actor: scores a group, reports metrics, answers ping."""

import pytest

from protocols.reward import RewardConfig
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup


def _group(prompt: Prompt, texts: list[str]) -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id="g0",
        trajectories=[
            Trajectory(group_id="g0", sample_index=i, prompt=prompt, response_token_ids=[5] * 3,
                       behavior_logprobs=[0.0] * 3, token_versions=[0] * 3, finish_reason="stop", response_text=t)
            for i, t in enumerate(texts)
        ],
    )


@pytest.mark.slow
def test_reward_worker_actor_scores_a_group(ray_cluster):
    ray = ray_cluster
    from actors.reward_worker import RewardWorker

    cfg = RewardConfig(verifier="math", num_processes=2, timeout_s=5.0)
    worker = ray.remote(RewardWorker).options(num_cpus=1).remote(cfg, 3)
    try:
        assert ray.get(worker.ping.remote()) == 3
        prompt = Prompt(prompt_id="math/test/0", prompt_token_ids=[0], answer=r"\frac{1}{2}")
        # 0.5 and \dfrac12 are 1/2; 2 is not; no box at all scores 0
        # only the rewards and results travel back, not the group
        # the scoring stage's call: a batch's groups, one (rewards, results) each
        [(rewards, results), (other, _)] = ray.get(worker.score_groups.remote(
            _group(prompt, [r"\boxed{0.5}", r"\boxed{\dfrac12}", r"\boxed{2}", "1/2"]),
            _group(prompt, [r"\boxed{1/2}"])))
        assert other == [1.0]
        assert rewards == [1.0, 1.0, 0.0, 0.0]
        assert [r.correct for r in results] == [True, True, False, False]
        assert results[3].info["reason"] == "no_boxed"
        metrics = ray.get(worker.metrics.remote())
        assert metrics["reward_worker/samples"] == 5  # both groups' samples
        assert metrics["reward_worker/error_exception"] == 0 and metrics["reward_worker/error_timeout"] == 0
        assert metrics["reward_worker/reward_mean"] == 3 / 5
    finally:
        ray.get(worker.shutdown.remote())
        ray.kill(worker)
