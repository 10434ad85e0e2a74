"""The `ppo` preset end to end on the real stack: vLLM rollout, reward workers, a DeepSpeed critic valuing each
batch at train time, GAE on the driver, and the critic training beside the policy learner."""

import json
import math

import pytest
import torch

from cluster.trainer import Trainer
from protocols.config import load_config
from protocols.metrics import unknown_names

pytestmark = pytest.mark.slow


def test_short_ppo_run_stamps_values_on_every_trajectory_and_a_dead_critic_past_the_limit_stops_it(ray_cluster,
                                                                                                      tmp_path):
    import ray

    from cluster.supervisor import WorkerLost

    # fault.max_replacements=0 (no death in the run itself): a critic rank killed after the run is one death too
    # many, so the error path is checked on the same Trainer (restarts themselves: tests/test_worker_failure.py)
    cfg = load_config(None, [f"output_dir={tmp_path}", "logging.plots=false",
                             "algorithm.preset=ppo", "critic.num_workers=1",
                             "train.steps=4", "train.max_staleness=1", "learner.prompts_per_step=4",
                             "rollout.samples_per_prompt=4", "data.num_eval_prompts=20", "fault.max_replacements=0"])
    trainer = Trainer(cfg)
    seen: list[tuple[int, list]] = []
    step = trainer.step

    def recording_step(groups):  # records what the learner trained on, then runs the real step
        seen.append((trainer.version, [t for g in groups for t in g.trajectories]))
        return step(groups)

    pool, valued = trainer.pools["critic"], []
    score_batch = pool.score_batch

    def recording_score_batch(batch):  # the values the step's GAE reads, and the critic's version then
        out = score_batch(batch)
        valued.append((pool.group.version, out))
        return out

    trainer.step, pool.score_batch = recording_step, recording_score_batch
    try:
        summary = trainer.run()
        # A dead critic worker past the restart limit stops the run with an error naming it, never a hang.
        ray.get(trainer.controller.resume.remote())
        ray.kill(trainer.pools["critic"].group.ranks[0])
        trainer.supervisor.start_runs()
        with pytest.raises(WorkerLost, match=r"critic worker 0 of critic.num_workers=1 died .*"
                                             r"fault.max_replacements=0 allows no more"):
            # groups the critic valued before its death may still fill a batch or two; the next wait meets it
            for _ in range(20):
                trainer._wait_for_batch()
        ray.get(trainer.controller.stop.remote())
        ray.get(trainer.supervisor.run_refs, timeout=60)
        stats = ray.get(trainer.controller.stats.remote())
    finally:
        trainer.shutdown()
    assert len(seen) == 4 and all(len(trajectories) == 16 for _, trajectories in seen)
    # every step's batch was valued by the critic as it stood before that step's update: never a stale one
    assert [version for version, _ in valued] == [0, 1, 2, 3]
    for version, batch in valued:
        assert batch.values.shape == batch.response_ids.shape
        assert bool(torch.isfinite(batch.values[batch.loss_mask]).all())
    # the head starts at 0 (critic.head_init_std=0): the first batch's values are 0; the trained critic's are not
    magnitude = [float(batch.values[batch.loss_mask].abs().sum()) for _, batch in valued]
    assert magnitude[0] == 0.0 and magnitude[-1] > 0.0, magnitude
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["critic/version"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    for r in rows:
        assert math.isfinite(r["critic/value_loss"]) and r["critic/value_loss"] >= 0
        assert "kl" in r  # k1 KL in the reward, from the reference policy
        assert unknown_names(r) == []  # critic/* among them: documented in protocols/metrics.py
    assert (tmp_path / "final_critic" / "value_head.pt").is_file()
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    # after the critic's death every admitted group is accounted for, and none was taken for a dead reward
    # worker's (those would be re-scored elsewhere)
    dropped = sum(v for k, v in stats.items() if k.startswith("queue/dropped_"))
    assert stats["queue/admitted"] == stats["queue/trained"] + dropped + stats["queue/depth"] + stats["queue/in_flight"]
    assert stats.get("queue/rescored_reward_worker_died", 0) == 0
    assert "queue/dropped_reward_worker_died" not in stats and "queue/dropped_reward_failed" not in stats
