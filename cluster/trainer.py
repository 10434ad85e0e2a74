"""The training driver: a linear recipe that wires the actor groups and runs the learner loop.

prompts -> rollout workers -> reward workers -> controller's replay queue -> learner -> versioned weights ->
rollout workers. The driver never asks a rollout worker for data: batches come only from the queue.
"""

import json
import logging
import time
from collections import Counter
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from actors.controller import ControllerActor
from actors.counter_poll import CounterPoll
from actors.reference_worker import ReferenceWorker
from actors.reward_worker import RewardWorker
from actors.rollout_worker import RolloutWorker
from cluster import checkpoint
from cluster.critic_group import CriticGroup, check_critic_model, critic_model_path, critic_returns
from cluster.evaluation import evaluate, evaluate_sets, load_eval_sets
from cluster.learner_group import LearnerGroup
from cluster.model_folder import fit_lengths_to_model, resolve_model_path
from cluster.placement import create_placement, precheck_embedded
from cluster.plots import plot_after_run
from cluster.ray_setup import reference_options, reward_options, rollout_options, start_ray
from cluster.reference_stream import check_streamed_ref_logprobs, reward_kl
from cluster.run_folder import RunFolder
from cluster.shared_folder import check_run_folder_shared
from cluster.supervisor import Supervisor
from cluster.weight_check import WeightCheck
from learner.objective import (
    apply_reward_shaping,
    compute_advantages,
    count_normalizer,
    finalize_metrics,
    kl_in_reward,
    needs_ref_logprobs,
)
from learner.weight_delta import delta_metrics
from protocols.config import RunConfig, dump_config
from protocols.metrics import length_metrics, reference_worker_metrics, reward_worker_metrics, rollout_metrics
from protocols.training_batch import TrainingBatch
from protocols.trajectory import Trajectory, TrajectoryGroup, WeightVersion
from rewards.datasets import load_prompts
from rewards.registry import resolve_verifier
from rewards.tool_calls import tool_counts, tool_metrics

log = logging.getLogger(__name__)


def staleness_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    lags = [version - t.min_version for t in trajectories]
    out = {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}
    for lag, count in sorted(Counter(lags).items()):
        out[f"staleness/hist_{lag}"] = count / len(lags)
    out["staleness/mixed_version_frac"] = sum(t.min_version != t.max_version for t in trajectories) / len(lags)
    return out


class Trainer:
    """Owns the actor groups of one run. `run()` is the whole job; tests use the pieces."""

    def __init__(self, cfg: RunConfig, resume_dir: str | Path | None = None) -> None:
        """`resume_dir`: continue the run in that folder from its newest complete checkpoint."""
        self.job_start = time.perf_counter()
        # phase seconds and wall time of the run so far; a resumed run starts from the checkpoint's
        self.totals: Counter = Counter()
        self.tool_totals: Counter = Counter()  # tools.* counts over the run (rewards/tool_calls.py tool_counts)
        self.wall_before = 0.0
        self.cfg = cfg
        # Fail on settings this version cannot run before any actor starts.
        resolve_verifier(cfg.reward.verifier)
        precheck_embedded(cfg)
        self.model_path = resolve_model_path(cfg)
        if cfg.critic.enabled:  # PPO's critic reads the policy's token ids: same tokenizer and vocabulary
            check_critic_model(self.model_path, critic_model_path(cfg, self.model_path),
                               cfg.model.trust_remote_code)
        self.cfg = cfg = fit_lengths_to_model(cfg, self.model_path)
        # every actor reads and writes the run folder by this one path, whatever its own working directory
        self.cfg = cfg = cfg.model_copy(update={"output_dir": str(Path(cfg.output_dir).resolve())})
        # --resume: the checkpoint must be complete and its shapes this config's, checked before any actor starts
        if resume_dir is not None and Path(resume_dir).resolve() != Path(cfg.output_dir).resolve():
            raise checkpoint.CheckpointError(f"resuming the run in {resume_dir} needs output_dir={resume_dir}, got "
                                             f"output_dir={cfg.output_dir!r}: a resumed run continues in its folder")
        self.resume_from = checkpoint.find_resume_checkpoint(resume_dir) if resume_dir is not None else None
        if self.resume_from is not None:
            checkpoint.check_compatible(self.resume_from, cfg.model_dump(mode="json"), self.model_path)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=cfg.model.trust_remote_code)
        # weight_sync.verify_every: the probe is built (and refused if it does not fit the engines) before any actor
        self.weight_check = (WeightCheck(cfg, len(tokenizer), cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens)
                             if cfg.weight_sync.verify_every else None)
        self.train_prompts, self.data_counts = load_prompts(cfg.data, "train", tokenizer)
        self.eval_prompts, eval_counts = load_prompts(cfg.data, "test", tokenizer)
        self.eval_prompts = self.eval_prompts[: cfg.data.num_eval_prompts]
        self.data_counts = {k: self.data_counts.get(k, 0) + eval_counts.get(k, 0) for k in {**self.data_counts, **eval_counts}}
        # train.eval_sets for the evaluation harness, loaded (and a bad file refused) before any actor starts
        self.eval_sets = load_eval_sets(cfg, tokenizer)
        start_ray(cfg)
        # Refuses a plan the cluster cannot hold (with the numbers) before any actor starts.
        self.placement = create_placement(cfg)
        # every rollout worker keeps one long poll (`watch`) open, so the actor serves more calls than workers
        self.controller = ray.remote(ControllerActor).options(
            num_cpus=0, max_concurrency=max(1000, 2 * cfg.rollout.num_workers + 64)).remote(
            self.train_prompts, cfg.learner.prompts_per_step, cfg.train.max_staleness,
            cfg.algorithm.dynamic_sampling, cfg.train.seed, cfg.rollout.num_workers,
            length_aware=cfg.rollout.length_aware_dispatch)
        self.reward_workers = [ray.remote(RewardWorker).options(**reward_options(cfg, self.placement, i)).remote(
                                   cfg.reward, i)
                               for i in range(cfg.reward.num_workers)]
        self.reward_counters = CounterPoll(self.reward_workers, "reward", reward_worker_metrics)
        # reference.num_workers > 0: the frozen reference scores groups on their way to the queue (the learner
        # ranks then hold no copy of it); 0 keeps it inside the learner.
        self.reference_workers = [
            ray.remote(ReferenceWorker).options(**reference_options(cfg, self.placement, i)).remote(
                cfg, i, self.model_path)
            for i in range(cfg.reference.num_workers)]
        self.reference_counters = CounterPoll(self.reference_workers, "reference", reference_worker_metrics)
        # the critic's ranks first (the rollout workers are given them), joined into their group below
        self.critic = (CriticGroup(cfg, critic_model_path(cfg, self.model_path), self.placement, join=False)
                       if cfg.critic.enabled else None)
        # The engines start in their actors while the learner group and the critic's start here: the starts
        # overlap (an engine start and a DeepSpeed group start each take tens of seconds, much of it waiting).
        self.rollout_workers = [
            ray.remote(RolloutWorker).options(**rollout_options(cfg, self.placement, i)).remote(
                cfg, i, self.model_path, self.controller, self.reward_workers,
                critic_workers=self.critic.workers if self.critic else None, reference_workers=self.reference_workers)
            for i in range(cfg.rollout.num_workers)
        ]
        self.learner = LearnerGroup(cfg, self.model_path, self.placement)
        if self.critic is not None:  # no group is scored before the run starts: the ids are known before any fails
            self.critic.join()
            ray.get(self.controller.set_critic_actor_ids.remote(self.critic.actor_ids()))
        # checkpoints and the final model are written by these ranks: one folder for all of them, on every node
        check_run_folder_shared(cfg.output_dir, {"learner": self.learner.ranks,
                                                 **({"critic": self.critic.ranks} if self.critic else {})},
                                cfg.fault.worker_start_timeout_s)
        ray.get([w.ping.remote() for w in self.reference_workers])
        ray.get([w.get_version.remote() for w in self.rollout_workers])
        self.learner.join_weight_group(self.rollout_workers)  # nothing to join unless the transport forms a group
        # worker failure: health checks, replacements (in these same lists) and bounded waits
        self.supervisor = Supervisor(cfg, self.placement, self.controller, self.model_path, self.learner,
                                     self.rollout_workers, self.reward_workers, self.critic,
                                     self.reference_workers)
        self.version = 0
        self.trained_group_ids: list[str] = []
        self.accuracy_before: float | None = None
        self.eval_before: dict = {}
        self.resume_report: dict = {}
        if self.resume_from is not None:
            self._restore(self.resume_from)

    def _wait_for_batch(self) -> tuple[list[TrajectoryGroup], float]:
        # a long poll on the controller, replacing dead workers meanwhile, within fault.batch_timeout_s
        return self.supervisor.wait_batch(self.version)

    def step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One learner update on a batch of groups, then publish the new weights."""
        cfg = self.cfg
        trajectories = [t for g in groups for t in g.trajectories]
        self.trained_group_ids.extend(g.group_id for g in groups)
        if any(t.min_version < self.version - cfg.train.max_staleness for t in trajectories):
            raise RuntimeError("the queue returned a sample older than train.max_staleness allows")
        batch = TrainingBatch.from_trajectories(trajectories)
        rewards, sample_mask = apply_reward_shaping(batch.rewards, batch.response_lengths, batch.truncated,
                                                    cfg.algorithm, cfg.rollout.max_response_tokens)
        batch = batch.with_sample_mask(sample_mask)
        if self.reference_workers:  # streamed with the trajectories: a missing one is a bug, named
            check_streamed_ref_logprobs(trajectories)
        elif needs_ref_logprobs(cfg.algorithm) and (kl_in_reward(cfg.algorithm) or cfg.learner.ppo_epochs > 1
                                                    or cfg.learner.mini_batches_per_step > 1):
            # scored once per step: the KL in the reward and every update of the batch read these
            batch = batch.with_fields(ref_logprobs=self.learner.ref_logprobs(batch))
        kl = reward_kl(batch, cfg.algorithm) if kl_in_reward(cfg.algorithm) else None
        if self.critic is not None:  # PPO: GAE over the values stamped in the stream; the returns train the critic
            batch = batch.with_fields(returns=critic_returns(batch, rewards, cfg.algorithm, kl))
        batch = batch.with_fields(advantages=compute_advantages(
            rewards, batch.loss_mask, cfg.rollout.samples_per_prompt, cfg.algorithm, kl=kl, values=batch.values))
        normalizer = count_normalizer(batch.loss_mask, cfg.rollout.max_response_tokens)
        t0 = time.perf_counter()
        critic_update, critic_metrics = None, {}
        if self.critic is not None:  # the critic's update runs while the policy's does
            critic_update = self.critic.start_train(batch)
        summed = self.learner.train_step(batch, normalizer)
        if critic_update is not None:
            critic_metrics = self.critic.finish(critic_update)
            critic_metrics["critic/staleness_max"] = float(self.version - min(t.critic_version for t in trajectories))
        learner_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        # the supervisor's: a collective broadcast that meets a dead engine is resent after its replacement
        published = self.supervisor.publish_weights(self.version + 1)
        self.version += 1
        weights = WeightVersion(version=self.version, num_tensors=published["num_tensors"],
                                num_bytes=published["num_bytes"])
        ray.get(self.controller.publish.remote(weights, published["refs"]))
        publish_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._score_probe()
        verify = {**self._check_weights(), "time/verify_s": time.perf_counter() - t0} if self.weight_check else {}
        correct = [bool(t.result and t.result.correct) for t in trajectories]
        num_tokens = int(batch.response_lengths.sum())
        errors = Counter(t.result.error for t in trajectories if t.result and t.result.error)
        tools = tool_counts(trajectories, cfg.tools) if cfg.tools.enabled else None
        self.tool_totals.update(tools or {})
        return {
            **{f"reward/error_{kind}": count for kind, count in errors.items()},
            **finalize_metrics(summed),
            **critic_metrics,
            **staleness_metrics(trajectories, self.version - 1),
            **(tool_metrics(tools) if tools else {}),
            "reward/mean": float(batch.rewards.mean()),
            "reward/shaped_mean": float(rewards.mean()),
            "reward/accuracy": sum(correct) / len(correct),
            "reward/error_frac": sum(bool(t.result and t.result.error) for t in trajectories) / len(trajectories),
            "response/length_mean": num_tokens / len(trajectories),
            **length_metrics(batch.response_lengths.tolist()),
            "response/truncated_frac": float(batch.truncated.float().mean()),
            "time/learner_s": learner_s,
            "time/publish_s": publish_s,
            "learner/tokens_per_s": num_tokens / max(learner_s, 1e-9),
            "weights/bytes": published["num_bytes"],
            **delta_metrics(published),
            **verify,
            "policy_version": self.version,
        }

    def run(self) -> dict:
        cfg = self.cfg
        folder = RunFolder(cfg, resume_step=self.version if self.resume_from is not None else None)
        if self.resume_from is None:
            self.accuracy_before = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, cfg.reward,
                                            report=self.eval_before)
        accuracy_before, eval_before = self.accuracy_before, self.eval_before
        log.warning("held-out accuracy before training: %.3f", accuracy_before)
        self.supervisor.start_runs()
        totals = self.totals
        bar = tqdm(range(self.version, cfg.train.steps), desc="train", dynamic_ncols=True)
        for _ in bar:
            step_start = time.perf_counter()
            groups, wait_s = self._wait_for_batch()
            metrics = self.step(groups)
            metrics["time/wait_s"] = wait_s
            metrics["time/step_s"] = time.perf_counter() - step_start
            totals.update({"wait_s": wait_s, "learner_s": metrics["time/learner_s"],
                           "publish_s": metrics["time/publish_s"], "step_s": metrics["time/step_s"]})
            if cfg.train.eval_every and self.version % cfg.train.eval_every == 0 and self.version < cfg.train.steps:
                metrics["eval/accuracy"] = self._evaluate_midway(report=metrics)
            if cfg.train.save_every and self.version % cfg.train.save_every == 0:
                self.save_checkpoint(folder.path)
            if self.version % cfg.train.log_every == 0:
                metrics.update(ray.get(self.controller.stats.remote(generated=True)))
                metrics.update(self._rollout_metrics())
                metrics.update(self.supervisor.metrics())
                metrics.update(self.reward_counters.read())
                metrics.update(self.reference_counters.read())
                metrics.update(self.data_counts)
                folder.log(self.version, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{metrics['reward/accuracy']:.2f}")
        self.supervisor.stop_runs()
        worker_reports = self.supervisor.reports()
        self.supervisor.ensure_alive()
        self._sync_idle_workers()
        self._check_weights(idle=True)  # the versions the workers loaded after their last report
        eval_after: dict = {}
        accuracy_after = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, cfg.reward,
                                  report=eval_after)
        log.warning("held-out accuracy after training: %.3f", accuracy_after)
        eval_after.update(evaluate_sets(self.rollout_workers, self.reward_workers, self.eval_sets, cfg, self.version))
        self.learner.save_hf(folder.final_model_dir)
        if self.critic is not None:
            self.critic.save(str(Path(folder.final_model_dir).parent / "final_critic"))
        stats = ray.get(self.controller.stats.remote())
        self.reward_counters.read(wait_s=30.0)
        self.reference_counters.read(wait_s=30.0)
        wall = self.wall_before + time.perf_counter() - self.job_start
        summary = {
            "accuracy_before": accuracy_before,
            # held-out checks that failed (verifier error or timeout, reward worker lost) count as wrong
            "eval_before": eval_before,
            "eval_after": eval_after,
            "accuracy_after": accuracy_after,
            "steps": self.version,
            "wall_seconds": wall,
            "train_seconds": totals["step_s"],
            "phase_seconds": {k: totals[k] for k in ("wait_s", "learner_s", "publish_s")},
            "rollout": worker_reports,
            "queue": stats,
            "replaced_workers": self.supervisor.replaced_counts(),
            "restart_seconds": list(self.supervisor.restart_seconds),
            "resent_publishes": self.supervisor.resent_publishes,
            **({"weight_sync_check": {"checks": self.weight_check.checks, "max_gap": self.weight_check.max_gap,
                                      "tolerance": self.weight_check.tolerance}} if self.weight_check else {}),
            "learner_skipped_nonfinite": int(metrics.get("learner/skipped_nonfinite", 0)),
            # every reward worker's counters over the whole run (the metrics.jsonl lines are per logged step)
            "reward_workers": self.reward_counters.totals(),
            **({"reference_workers": self.reference_counters.totals()} if self.reference_workers else {}),
            # tools/* over every trained sample of the run
            **({"tools": tool_metrics(self.tool_totals)} if cfg.tools.enabled else {}),
            "final_model": folder.final_model_dir,
            "trained_group_ids": list(self.trained_group_ids),
            **({"resume": self.resume_report} if self.resume_report else {}),
        }
        folder.write_summary(summary)
        folder.close()
        if cfg.logging.plots:
            plot_after_run(folder.path)  # PNG figures of metrics.jsonl in RUN_DIR/plots (cluster/plots.py)
        return summary

    def save_checkpoint(self, run_dir: Path) -> Path:
        """Checkpoint the run between two steps into run_dir/checkpoints/step_N (layout, atomic write, `latest`
        and pruning: cluster/checkpoint.py). The controller's state is read after the learner's: groups that
        arrive meanwhile were leased at that read, so a resume re-issues them. Returns the folder."""
        def write(folder: Path) -> None:
            self.learner.save_hf(str(folder / "policy"))
            (folder / "learner").mkdir()
            digests = self.learner.save_state(str(folder / "learner"))
            critic_version = None
            if self.critic is not None:  # PPO's value model and its optimizer resume with the policy
                (folder / "critic").mkdir()
                critic_version = self.critic.save_state(str(folder / "critic"))
            state = {"policy_version": self.version, "metrics_step": self.version, "critic_version": critic_version,
                     "trained_group_ids": self.trained_group_ids, "accuracy_before": self.accuracy_before,
                     "eval_before": self.eval_before, "optimizer_digests": digests,
                     "phase_totals": dict(self.totals), "tool_totals": dict(self.tool_totals),
                     "wall_seconds": self.wall_before + time.perf_counter() - self.job_start,
                     "controller": ray.get(self.controller.state_dict.remote())}
            (folder / "state.json").write_text(json.dumps(state))
            (folder / "config.yaml").write_text(dump_config(self.cfg))

        return checkpoint.save(run_dir, self.version, self.cfg.train.keep_checkpoints, write)

    def _restore(self, folder: Path) -> None:
        """Continue from a checkpoint: the learner (weights, optimizer, RNG states), the controller (cursor, queue,
        counters, groups in flight to re-issue), the driver's counters; then publish the restored weights so the
        rollout workers (started on the initial model) load them before they take any work."""
        state = checkpoint.read_state(folder)
        loaded = self.learner.load_state(str(folder / "learner"))
        if loaded != state["optimizer_digests"]:
            raise RuntimeError(f"--resume from {folder}: the learner's optimizer state after loading ({loaded}) "
                               f"differs from the one saved ({state['optimizer_digests']}); the checkpoint is damaged")
        if self.critic is not None:
            if state.get("critic_version") is None:
                raise checkpoint.CheckpointError(f"--resume from {folder}: this run has a critic (critic.num_workers="
                                                 f"{self.cfg.critic.num_workers}) but the checkpoint holds none")
            self.critic.load_state(str(folder / "critic"))
        ray.get(self.controller.load_state_dict.remote(state["controller"]))
        self.version = state["policy_version"]
        self.trained_group_ids = list(state["trained_group_ids"])
        self.accuracy_before, self.eval_before = state["accuracy_before"], state["eval_before"]
        # the summary's timings cover the whole run up to this checkpoint plus what follows; the time between
        # the checkpoint and the crash is not counted
        self.totals = Counter(state.get("phase_totals", {}))
        self.tool_totals = Counter(state.get("tool_totals", {}))
        self.wall_before = float(state.get("wall_seconds", 0.0))
        published = self.learner.publish_weights(self.version)
        weights = WeightVersion(version=self.version, num_tensors=published["num_tensors"],
                                num_bytes=published["num_bytes"])
        ray.get(self.controller.publish.remote(weights, published["refs"]))
        self._score_probe()
        self.resume_report = {"checkpoint": str(folder), "policy_version": self.version,
                              "reissued_groups": len(state["controller"]["in_flight"]), "optimizer_loaded": loaded}
        log.warning("resumed from %s at policy version %d (%d groups in flight re-issued)", folder, self.version,
                    self.resume_report["reissued_groups"])

    def _score_probe(self) -> None:
        """The learner's log-probs of the weight-sync probe at the version just published, if it is checked."""
        if self.weight_check is None or not self.weight_check.due(self.version):
            return
        groups = self.cfg.learner.num_ranks // self.cfg.learner.sequence_parallel_size
        batch = self.weight_check.learner_batch(groups)
        self.weight_check.record_learner(self.version, batch.per_sample_rows(self.learner.probe_logprobs(batch)))

    def _check_weights(self, idle: bool = False) -> dict[str, float]:
        """Compare the engines' probe results reported since the last call with the learner's (`idle`: the
        workers are between runs, so ask them directly). Raises WeightSyncMismatch on a gap above
        weight_sync.verify_tolerance. Returns weights/verify_*."""
        if self.weight_check is None:
            return {}
        if idle:
            results = ray.get([w.weight_probes.remote() for w in self.rollout_workers])
            self.weight_check.compare_reports({wid: {"weight_probes": r}
                                               for wid, r in zip(self.supervisor.rollout_ids, results)})
        else:
            self.weight_check.compare_reports(ray.get(self.controller.get_worker_stats.remote()))
        return self.weight_check.metrics()

    def _rollout_metrics(self) -> dict[str, float]:
        return rollout_metrics(ray.get(self.controller.get_worker_stats.remote()).values())

    def _sync_idle_workers(self) -> None:
        """After the loop, bring every worker to the last published weights (for evaluation)."""
        latest = ray.get(self.controller.latest_weights.remote(-1))
        if latest is None:
            return
        versions = ray.get([w.get_version.remote() for w in self.rollout_workers])
        ray.get([w.load_weights.remote(*latest) for w, v in zip(self.rollout_workers, versions) if v < latest[0]])

    def _evaluate_midway(self, report: dict | None = None) -> float:
        """Pause generation, evaluate with the newest weights, and restart the workers."""
        self.supervisor.stop_runs()
        self.supervisor.ensure_alive()
        self._sync_idle_workers()
        accuracy = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, self.cfg.reward,
                            report=report)
        if report is not None:
            report.update(evaluate_sets(self.rollout_workers, self.reward_workers, self.eval_sets, self.cfg,
                                        self.version))
        ray.get(self.controller.resume.remote())
        self.supervisor.start_runs()
        return accuracy

    def shutdown(self) -> None:
        self.learner.shutdown()
        if self.critic is not None:
            self.critic.shutdown()
        for actor in [*self.rollout_workers, *self.reward_workers, *self.reference_workers, self.controller]:
            ray.kill(actor)
        self.placement.remove()


def train(cfg: RunConfig, resume_dir: str | Path | None = None) -> dict:
    trainer = Trainer(cfg, resume_dir)
    try:
        return trainer.run()
    finally:
        trainer.shutdown()
