"""The training driver: a linear recipe that wires the actor groups and runs the learner loop.

prompts -> rollout workers -> the controller's scoring stage (reward workers, token scorers, critic) -> its replay
queue -> learner -> versioned weights -> rollout workers. Tokens are put once where they were made; the queue
holds refs, and the driver fetches a batch's tokens by ref. The driver never asks a rollout worker for data: batches come only from the queue.
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
from cli.plots import plot_after_run
from cluster import checkpoint
from cluster.evaluation import evaluate, evaluate_sets, load_eval_sets
from cluster.gateway_endpoints import write_endpoints
from cluster.learner_group import LearnerGroup
from cluster.model_folder import fit_lengths_to_model, resolve_model_path
from cluster.waits import get_within
from cluster.placement import create_placement, gpu_visibility, precheck_embedded
from cluster.pools import check_roles, start_pools
from cluster.ray_setup import start_ray
from cluster.run_folder import RunFolder
from cluster.scale_requests import DriverHeartbeat, ScaleInbox
from cluster.scaling import Scaling
from cluster.shared_folder import check_run_folder_shared
from cluster.supervisor import Supervisor
from cluster.worker_pool import PoolContext
from learner.objective import finalize_metrics
from learner.prepare import (
    check_streamed_scores,
    learner_scores_ref,
    prepare_batch,
    staleness_metrics,
)
from protocols.config import RunConfig, dump_config
from protocols.metrics import gateway_metrics, length_metrics, rollout_metrics, source_metrics
from protocols.training_batch import TrainingBatch
from protocols.trajectory import TrajectoryGroup
from rewards.datasets import load_prompts
from rewards.environment import prompt_tools
from rewards.registry import resolve_verifier
from rewards.tool_calls import tool_counts, tool_metrics
from weights.delta import delta_metrics
from weights.sync_check import WeightCheck

log = logging.getLogger(__name__)


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
        check_roles(cfg, self.model_path)  # e.g. PPO's critic must share the policy's tokenizer (cluster/pools.py)
        self.cfg = cfg = fit_lengths_to_model(cfg, self.model_path)
        # every actor reads and writes the run folder by this one path, whatever its own working directory
        self.cfg = cfg = cfg.model_copy(update={"output_dir": str(Path(cfg.output_dir).resolve())})
        # --resume: the checkpoint must be complete and its shapes this config's, checked before any actor starts
        if resume_dir is not None and Path(resume_dir).resolve() != Path(cfg.output_dir).resolve():
            raise checkpoint.CheckpointError(f"resuming the run in {resume_dir} needs output_dir={resume_dir}, got "
                                             f"output_dir={cfg.output_dir!r}: a resumed run continues in its folder")
        self.resume_from = checkpoint.find_resume_checkpoint(resume_dir) if resume_dir is not None else None
        if cfg.gateway.enabled:  # an earlier run's file in this folder must not send agents to its dead endpoints
            write_endpoints(cfg, [], ready=False, policy_version=0)
        if self.resume_from is not None:
            checkpoint.check_compatible(self.resume_from, cfg.model_dump(mode="json"), self.model_path)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=cfg.model.trust_remote_code)
        # weight_sync.verify_every: the probe is built (and refused if it does not fit the engines) before any actor
        self.weight_check = (WeightCheck(cfg, len(tokenizer), cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens)
                             if cfg.weight_sync.verify_every else None)
        self.train_prompts, self.eval_prompts, self.data_counts = [], [], {}
        if cfg.gateway.outside_only:  # outside agents bring the tasks: no data set, no held-out split
            log.warning("gateway.outside_only=true: the run leases no prompts and loads no data set; its groups are "
                        "the sessions outside agents open (RUN/gateway/endpoints.json, docs/agents.md)")
        else:
            tools = prompt_tools(cfg.tools)
            self.train_prompts, self.data_counts = load_prompts(cfg.data, "train", tokenizer, tools)
            self.eval_prompts, eval_counts = load_prompts(cfg.data, "test", tokenizer, tools)
            self.eval_prompts = self.eval_prompts[: cfg.data.num_eval_prompts]
            self.data_counts = {k: self.data_counts.get(k, 0) + eval_counts.get(k, 0)
                                for k in {**self.data_counts, **eval_counts}}
        # train.eval_sets for the evaluation harness, loaded (and a bad file refused) before any actor starts
        self.eval_sets = load_eval_sets(cfg, tokenizer)
        start_ray(cfg)
        # Refuses a plan the cluster cannot hold (with the numbers) before any actor starts.
        self.placement = create_placement(cfg)
        # every rollout worker keeps one long poll (`watch`) open, so the actor serves more calls than workers
        self.controller = ray.remote(ControllerActor).options(
            num_cpus=0, max_concurrency=max(1000, 2 * cfg.rollout.num_workers + 64), **gpu_visibility(0)).remote(
            self.train_prompts, cfg.learner.prompts_per_step, cfg.train.max_staleness,
            cfg.algorithm.dynamic_sampling, cfg.train.seed, cfg.rollout.num_workers,
            length_aware=cfg.rollout.length_aware_dispatch, from_data=not cfg.gateway.outside_only,
            max_rescore_attempts=cfg.fault.max_rescore_attempts, scoring_timeout_s=cfg.fault.scoring_timeout_s,
            source_weights=cfg.data.source_weights())
        # A pool per role (cluster/pools.py). Every role's actors start, none waited for, while the learner group
        # starts here; then each pool waits for its own, the critic's ranks first (they join their group). The starts
        # overlap: an engine start and a DeepSpeed group start each take tens of seconds, much of it waiting.
        pools = PoolContext(cfg, self.controller, self.placement, self.model_path)
        self.pools = start_pools(pools)
        self.learner = pools.learner = LearnerGroup(cfg, self.model_path, self.placement)
        for pool in self.pools.values():
            pool.ready()
        # checkpoints and the final model are written by these ranks: one folder for all of them, on every node
        writers = {name: pool.writers() for name, pool in self.pools.items() if pool.writers()}  # the critic's
        check_run_folder_shared(cfg.output_dir, {"learner": self.learner.ranks, **writers},
                                cfg.fault.worker_start_timeout_s)
        # the pools' own lists (replacements and resizes change them in place), by the names the loop reads
        self.rollout_workers = self.pools["rollout"].workers
        self.reward_workers = self.pools["reward"].workers
        self.reference_workers = self.pools["reference"].workers
        self.training_pools = [pool for pool in self.pools.values() if pool.trains]  # PPO's critic, or none
        self.learner.join_weight_group(self.rollout_workers)  # nothing to join unless the transport forms a group
        # worker failure: health checks, replacements and bounded waits, pool by pool
        self.supervisor = Supervisor(cfg, self.controller, self.pools)
        # resizes of the rollout pool while the job runs: `relayrl scale`, the autoscaler
        self.scaling = Scaling(cfg, self.pools, lambda: ray.get(self.controller.stats.remote(),
                                                                timeout=cfg.fault.worker_start_timeout_s))
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
        batch = TrainingBatch.from_trajectories(trajectories)
        staleness = staleness_metrics(trajectories, self.version)
        sources = source_metrics(trajectories, self.version)  # {} unless the data is a mixture (data.tasks)
        if staleness["staleness/max"] > cfg.train.max_staleness:
            raise RuntimeError(f"the queue returned a sample {staleness['staleness/max']:.0f} versions old, more than "
                               f"train.max_staleness={cfg.train.max_staleness} allows")
        check_streamed_scores(batch, cfg, [t.group_id for t in trajectories])
        if learner_scores_ref(cfg):  # scored once per step: the KL in the reward and every update read these
            batch = batch.with_fields(ref_logprobs=self.learner.ref_logprobs(batch))
        for pool in self.training_pools:  # PPO's critic values the batch as it is before its update (GAE reads it)
            batch = pool.score_batch(batch)
        prepared = prepare_batch(batch, cfg)
        batch, rewards, normalizer = prepared.batch, prepared.shaped_rewards, prepared.normalizer
        t0 = time.perf_counter()
        # roles that train beside the policy (PPO's critic) run their updates while the policy's does
        updates = [(pool, pool.start_update(batch)) for pool in self.training_pools]
        summed = self.learner.train_step(batch, normalizer)
        pool_metrics = {}
        for pool, started in updates:
            pool_metrics.update(pool.finish_update(started))
        learner_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        # the supervisor's: a collective broadcast that meets a dead engine is resent after its replacement
        published = self.supervisor.publish_weights(self.version + 1)
        self.version += 1
        self._call(self.controller.publish.remote(published), "the controller's publish")
        publish_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self._score_probe()
        verify = {**self._check_weights(), "time/verify_s": time.perf_counter() - t0} if self.weight_check else {}
        correct = [bool(t.result and t.result.correct) for t in trajectories]
        num_tokens = int(batch.response_lengths.sum())
        errors = Counter(t.result.error for t in trajectories if t.result and t.result.error)
        tools = tool_counts(trajectories) if cfg.tools.enabled else None
        self.tool_totals.update(tools or {})
        return {
            **{f"reward/error_{kind}": count for kind, count in errors.items()},
            **finalize_metrics(summed),
            **pool_metrics,
            **prepared.metrics,
            **staleness,
            **sources,
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
            "weights/bytes": published.num_bytes,
            **delta_metrics(published),
            **verify,
            "policy_version": self.version,
        }

    def run(self) -> dict:
        cfg = self.cfg
        folder = RunFolder(cfg, resume_step=self.version if self.resume_from is not None else None)
        # while it beats, `relayrl scale RUN_DIR` knows the job runs (cluster/scale_requests.py check_running)
        heartbeat = DriverHeartbeat(folder.path).start()
        try:
            return self._run(folder)
        finally:
            heartbeat.stop()

    def _run(self, folder: RunFolder) -> dict:
        cfg = self.cfg
        if self.resume_from is None:
            self.accuracy_before = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, cfg.reward,
                                            report=self.eval_before, timeout_s=cfg.fault.eval_timeout_s)
        accuracy_before, eval_before = self.accuracy_before, self.eval_before
        if self.eval_prompts:
            log.warning("held-out accuracy before training: %.3f", accuracy_before)
        self._start_runs()
        inbox = ScaleInbox(folder.path)  # `relayrl scale RUN_DIR ...` requests, applied between steps
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
            metrics.update(self.scaling.after_step(metrics, self.version, inbox))
            self._write_endpoints(ready=True)  # the new version, and the endpoints of replaced or added workers
            if cfg.train.save_every and self.version % cfg.train.save_every == 0:
                self.save_checkpoint(folder.path)
            if self.version % cfg.train.log_every == 0:
                metrics.update(self._call(self.controller.stats.remote(generated=True), "the controller's stats"))
                metrics.update(self._rollout_metrics())
                metrics.update(self.supervisor.metrics())
                for pool in self.pools.values():  # reward and reference workers' counters
                    metrics.update(pool.read_counters())
                metrics.update(self.data_counts)
                metrics["rollout/num_workers"] = float(len(self.rollout_workers))
                folder.log(self.version, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{metrics['reward/accuracy']:.2f}")
        self.scaling.settle(inbox, self.version)  # a resize under way ends, for the last evaluation
        self._stop_runs(finished=True)
        worker_reports = self.supervisor.reports()
        self.supervisor.ensure_alive()
        self._sync_idle_workers()
        self._check_weights(idle=True)  # the versions the workers loaded after their last report
        eval_after: dict = {}
        accuracy_after = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, cfg.reward,
                                  report=eval_after, timeout_s=cfg.fault.eval_timeout_s)
        if self.eval_prompts:
            log.warning("held-out accuracy after training: %.3f", accuracy_after)
        else:  # (outside-only: no held-out split)
            accuracy_before = accuracy_after = None
        eval_after.update(evaluate_sets(self.rollout_workers, self.reward_workers, self.eval_sets, cfg, self.version))
        self.learner.save_hf(folder.final_model_dir)
        for pool in self.pools.values():  # the critic's final_critic beside final_model
            pool.save_final(Path(folder.final_model_dir).parent)
        stats = self._call(self.controller.stats.remote(), "the controller's stats")
        for pool in self.pools.values():
            pool.read_counters(wait_s=30.0)
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
            # every reward (and reference) worker's counters over the whole run (the metrics.jsonl lines are per
            # logged step): reward_workers, reference_workers
            **{f"{name}_workers": totals for name, pool in self.pools.items()
               if (totals := pool.counter_totals()) is not None},
            # tools/* over every trained sample of the run
            **({"tools": tool_metrics(self.tool_totals)} if cfg.tools.enabled else {}),
            "final_model": folder.final_model_dir,
            "trained_group_ids": list(self.trained_group_ids),
            **({"resume": self.resume_report} if self.resume_report else {}),
        }
        folder.write_summary(summary)
        folder.close()
        if cfg.logging.plots:
            plot_after_run(folder.path)  # PNG figures of metrics.jsonl in RUN_DIR/plots (cli/plots.py)
        return summary

    def scale(self, rollout_workers: int) -> float:
        """Resize the rollout pool to `rollout_workers` and wait until it is done (cluster/scaling.py
        `Scaling.scale`: the errors, the seconds it returns). A running job is resized with `relayrl scale RUN_DIR`
        instead, between two steps and without pausing the learner."""
        return self.scaling.scale(rollout_workers)

    def save_checkpoint(self, run_dir: Path) -> Path:
        """Checkpoint the run between two steps into run_dir/checkpoints/step_N (layout, atomic write, `latest`
        and pruning: cluster/checkpoint.py). The controller's state is read after the learner's: groups that
        arrive meanwhile were leased at that read, so a resume re-issues them. Returns the folder."""
        def write(folder: Path) -> None:
            self.learner.save_hf(str(folder / "policy"))
            (folder / "learner").mkdir()
            digests = self.learner.save_state(str(folder / "learner"))
            roles = {}  # e.g. PPO's value model and its optimizer, which resume with the policy
            for pool in self.pools.values():
                roles.update(pool.save_state(folder))
            state = {"policy_version": self.version, "metrics_step": self.version, **roles,
                     "trained_group_ids": self.trained_group_ids, "accuracy_before": self.accuracy_before,
                     "eval_before": self.eval_before, "optimizer_digests": digests,
                     "phase_totals": dict(self.totals), "tool_totals": dict(self.tool_totals),
                     "wall_seconds": self.wall_before + time.perf_counter() - self.job_start,
                     "controller": self._call(self.controller.state_dict.remote(), "the controller's state")}
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
        for pool in self.pools.values():  # e.g. PPO's critic group
            pool.load_state(folder, state)
        self._call(self.controller.load_state_dict.remote(state["controller"]), "the controller's state load")
        self.version = state["policy_version"]
        self.trained_group_ids = list(state["trained_group_ids"])
        self.accuracy_before, self.eval_before = state["accuracy_before"], state["eval_before"]
        # the summary's timings cover the whole run up to this checkpoint plus what follows; the time between
        # the checkpoint and the crash is not counted
        self.totals = Counter(state.get("phase_totals", {}))
        self.tool_totals = Counter(state.get("tool_totals", {}))
        self.wall_before = float(state.get("wall_seconds", 0.0))
        self._call(self.controller.publish.remote(self.learner.publish_weights(self.version)), "the controller's publish")
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
            results = self._call([w.weight_probes.remote() for w in self.rollout_workers], "the rollout workers' weight probes")
            self.weight_check.compare_reports({wid: {"weight_probes": r}
                                               for wid, r in zip(self.supervisor.rollout_ids, results)})
        else:
            self.weight_check.compare_reports(self._call(self.controller.get_worker_stats.remote(), "the workers' reports"))
        return self.weight_check.metrics()

    def _rollout_metrics(self) -> dict[str, float]:
        reports = list(self._call(self.controller.get_worker_stats.remote(), "the workers' reports").values())
        return {**rollout_metrics(reports), **gateway_metrics(reports)}

    def _call(self, refs, what: str):
        """A call that only reads or records, within fault.call_timeout_s (cluster/waits.py)."""
        return get_within(refs, self.cfg.fault.call_timeout_s, what, "fault.call_timeout_s")

    def _sync_idle_workers(self) -> None:
        """After the loop, bring every worker to the last published weights (for evaluation)."""
        latest = self._call(self.controller.latest_weights.remote(-1), "the controller's newest weights")
        if latest is None:
            return
        versions = self._call([w.get_version.remote() for w in self.rollout_workers], "the rollout workers' versions")
        get_within([w.load_weights.remote(latest) for w, v in zip(self.rollout_workers, versions)
                    if v < latest.version], self.cfg.fault.worker_start_timeout_s, "the idle rollout workers' weight load",
                   "fault.worker_start_timeout_s")

    def _evaluate_midway(self, report: dict | None = None) -> float:
        """Pause generation, evaluate with the newest weights, and restart the workers."""
        self._stop_runs()
        self.supervisor.ensure_alive()
        self._sync_idle_workers()
        accuracy = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, self.cfg.reward,
                            report=report, timeout_s=self.cfg.fault.eval_timeout_s)
        if report is not None:
            report.update(evaluate_sets(self.rollout_workers, self.reward_workers, self.eval_sets, self.cfg,
                                        self.version))
        self._call(self.controller.resume.remote(), "the controller's resume")
        self._start_runs()
        return accuracy

    def _start_runs(self) -> None:
        self.supervisor.start_runs()
        self._write_endpoints(ready=True)

    def _stop_runs(self, finished: bool = False) -> None:
        self._write_endpoints(ready=False, finished=finished)  # agents hold off before calls start to wait
        self.supervisor.stop_runs()

    def _write_endpoints(self, ready: bool, finished: bool = False) -> None:
        """gateway.enabled: RUN/gateway/endpoints.json, the endpoints and whether they serve calls now."""
        if self.cfg.gateway.enabled:
            write_endpoints(self.cfg, self.supervisor.rollout_ids, ready, self.version, finished)

    def shutdown(self) -> None:
        self._write_endpoints(ready=False, finished=True)  # also after a run that raised
        self.scaling.release()
        self.learner.shutdown()
        for pool in self.pools.values():
            pool.shutdown()
        ray.kill(self.controller)
        self.placement.remove()


def train(cfg: RunConfig, resume_dir: str | Path | None = None) -> dict:
    trainer = Trainer(cfg, resume_dir)
    try:
        return trainer.run()
    finally:
        trainer.shutdown()
