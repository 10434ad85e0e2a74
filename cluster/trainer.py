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
from actors.reward_worker import RewardWorker, score_on_workers
from actors.rollout_worker import RolloutWorker
from cluster.learner_group import LearnerGroup
from cluster.placement import create_placement, precheck_embedded
from cluster.ray_setup import reward_options, rollout_options, start_ray
from cluster.run_folder import RunFolder
from learner.objective import (
    apply_reward_shaping,
    compute_advantages,
    count_normalizer,
    finalize_metrics,
    kl_for_reward,
    kl_in_reward,
    needs_values,
)
from learner.batch import pad_per_token
from protocols.config import RunConfig
from protocols.reward import RewardConfig
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup, WeightVersion
from rewards.datasets import load_prompts
from rewards.registry import resolve_verifier

log = logging.getLogger(__name__)


def resolve_model_path(cfg: RunConfig) -> str:
    """The policy's HF folder: `model.path`, or the cached warm-started demo model."""
    if cfg.model.path:
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise ValueError(
                f"model.path={cfg.model.path!r} is not a Hugging Face model folder (no config.json there); give a "
                "local folder with config.json, weights and tokenizer, or leave model.path empty for the demo model"
            )
        return cfg.model.path
    from cluster.demo_model import prepare_demo_model

    return prepare_demo_model(demo=cfg.model.demo, data=cfg.data)


def fit_lengths_to_model(cfg: RunConfig, model_path: str) -> RunConfig:
    """Prompt + response must fit the model's context; shrink data.max_prompt_tokens to fit, or fail early."""
    model_cfg = json.loads((Path(model_path) / "config.json").read_text())
    limit = model_cfg.get("max_position_embeddings")
    if not limit or cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens <= limit:
        return cfg
    room = limit - cfg.rollout.max_response_tokens
    if room < 1:
        raise ValueError(
            f"rollout.max_response_tokens={cfg.rollout.max_response_tokens} leaves no room for a prompt in the "
            f"model's context of {limit} tokens (max_position_embeddings in {model_path}/config.json); lower it"
        )
    log.warning("data.max_prompt_tokens=%d lowered to %d to fit the model's context of %d tokens",
                cfg.data.max_prompt_tokens, room, limit)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_prompt_tokens": room})})


def batch_tensors(trajectories: list[Trajectory], cfg: RunConfig) -> dict:
    """Per-sample lists for the learner plus the global-batch tensors the driver needs for advantages."""
    lengths = torch.tensor([len(t.response_token_ids) for t in trajectories])
    width = max(1, int(lengths.max()))
    loss_mask = torch.arange(width)[None, :] < lengths[:, None]
    truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return {"lengths": lengths, "loss_mask": loss_mask, "truncated": truncated, "rewards": rewards, "width": width}


def staleness_metrics(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    lags = [version - t.min_version for t in trajectories]
    out = {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}
    for lag, count in sorted(Counter(lags).items()):
        out[f"staleness/hist_{lag}"] = count / len(lags)
    out["staleness/mixed_version_frac"] = sum(t.min_version != t.max_version for t in trajectories) / len(lags)
    return out


def evaluate(workers: list, prompts: list[Prompt], reward_workers: list, reward_cfg: RewardConfig,
             report: dict | None = None) -> float:
    """Greedy held-out accuracy: prompts split over the rollout workers, responses scored by the reward workers
    (with their timeouts, each prompt's own verifier and the run's `reward.*` settings). A verifier error or
    timeout, or a reward worker lost, counts as wrong and is logged with counts by kind (also put in `report`,
    when given, as `eval/error_<kind>` and `eval/samples`); it never stops the run."""
    if not prompts:
        return float("nan")
    chunks = [prompts[i::len(workers)] for i in range(len(workers))]
    texts = ray.get([w.generate_greedy.remote(c) for w, c in zip(workers, chunks)])
    flat_prompts = [p for chunk in chunks for p in chunk]
    flat_texts = [t for outs in texts for t in outs]
    correct, errors = score_on_workers(reward_workers, flat_prompts, flat_texts, reward_cfg)
    if errors:
        log.warning("held-out evaluation: %d of %d checks failed and count as wrong (%s)", sum(errors.values()),
                    len(prompts), ", ".join(f"{kind} {n}" for kind, n in sorted(errors.items())))
    if report is not None:
        report["eval/samples"] = len(prompts)
        report.update({f"eval/error_{kind}": n for kind, n in errors.items()})
    return sum(correct) / len(prompts)


class Trainer:
    """Owns the actor groups of one run. `run()` is the whole job; tests use the pieces."""

    def __init__(self, cfg: RunConfig) -> None:
        self.job_start = time.perf_counter()
        self.cfg = cfg
        # Fail on settings this version cannot run before any actor starts.
        resolve_verifier(cfg.reward.verifier)
        if needs_values(cfg.algorithm):
            raise ValueError(
                f"algorithm.preset={cfg.algorithm.preset!r} uses advantage.type=gae, which needs a critic worker "
                "group; this version does not start one yet. Choose a critic-free preset (grpo, rloo, dr_grpo, "
                "dapo, gspo, cispo, reinforce, reinforce_pp)")
        precheck_embedded(cfg)
        self.model_path = resolve_model_path(cfg)
        self.cfg = cfg = fit_lengths_to_model(cfg, self.model_path)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=cfg.model.trust_remote_code)
        self.train_prompts, self.data_counts = load_prompts(cfg.data, "train", tokenizer)
        self.eval_prompts, eval_counts = load_prompts(cfg.data, "test", tokenizer)
        self.eval_prompts = self.eval_prompts[: cfg.data.num_eval_prompts]
        self.data_counts = {k: self.data_counts.get(k, 0) + eval_counts.get(k, 0) for k in {**self.data_counts, **eval_counts}}
        start_ray(cfg)
        # Refuses a plan the cluster cannot hold (with the numbers) before any actor starts.
        self.placement = create_placement(cfg)
        # every rollout worker keeps one long poll (`watch`) open, so the actor serves more calls than workers
        self.controller = ray.remote(ControllerActor).options(
            num_cpus=0, max_concurrency=max(1000, 2 * cfg.rollout.num_workers + 64)).remote(
            self.train_prompts, cfg.learner.prompts_per_step, cfg.train.max_staleness,
            cfg.algorithm.dynamic_sampling, cfg.train.seed, cfg.rollout.num_workers)
        self.reward_workers = [ray.remote(RewardWorker).options(**reward_options(cfg, self.placement, i)).remote(
                                   cfg.reward, i)
                               for i in range(cfg.reward.num_workers)]
        self.learner = LearnerGroup(cfg, self.model_path, self.placement)
        self.rollout_workers = [
            ray.remote(RolloutWorker).options(**rollout_options(cfg, self.placement, i)).remote(
                cfg, i, self.model_path, self.controller, self.reward_workers)
            for i in range(cfg.rollout.num_workers)
        ]
        ray.get([w.get_version.remote() for w in self.rollout_workers])
        if cfg.weight_sync.type == "collective":
            self.learner.join_weight_group(self.rollout_workers)
        self.version = 0
        self.trained_group_ids: list[str] = []

    def _wait_for_batch(self) -> tuple[list[TrajectoryGroup], float]:
        start = time.perf_counter()
        while True:  # a long poll: the controller answers once the batch is complete (or after 1 s)
            groups = ray.get(self.controller.wait_batch.remote(self.version, 1.0))
            if groups is not None:
                return groups, time.perf_counter() - start

    def step(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """One learner update on a batch of groups, then publish the new weights."""
        cfg = self.cfg
        trajectories = [t for g in groups for t in g.trajectories]
        self.trained_group_ids.extend(g.group_id for g in groups)
        if any(t.min_version < self.version - cfg.train.max_staleness for t in trajectories):
            raise RuntimeError("the queue returned a sample older than train.max_staleness allows")
        bt = batch_tensors(trajectories, cfg)
        rewards, sample_mask = apply_reward_shaping(bt["rewards"], bt["lengths"], bt["truncated"], cfg.algorithm,
                                                    cfg.rollout.max_response_tokens)
        loss_mask = bt["loss_mask"] & sample_mask[:, None]
        samples = {
            "prompt_ids": [t.prompt.prompt_token_ids for t in trajectories],
            "response_ids": [t.response_token_ids for t in trajectories],
            "behavior_logprobs": [t.behavior_logprobs for t in trajectories],
            "sample_mask": sample_mask.tolist(),
        }
        kl = None
        if kl_in_reward(cfg.algorithm):
            ref = pad_per_token(self.learner.ref_logprobs(samples), bt["width"])
            behavior = pad_per_token(samples["behavior_logprobs"], bt["width"])
            kl = kl_for_reward(behavior, ref, loss_mask, cfg.algorithm)
        advantages = compute_advantages(rewards, loss_mask, cfg.rollout.samples_per_prompt, cfg.algorithm, kl=kl)
        samples["advantages"] = [row[: len(r)].tolist() for row, r in zip(advantages, samples["response_ids"])]
        normalizer = count_normalizer(loss_mask, cfg.rollout.max_response_tokens)
        t0 = time.perf_counter()
        summed = self.learner.train_step(samples, normalizer)
        learner_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        published = self.learner.publish_weights(self.version + 1)
        self.version += 1
        weights = WeightVersion(version=self.version, num_tensors=published["num_tensors"],
                                num_bytes=published["num_bytes"])
        ray.get(self.controller.publish.remote(weights, published["refs"]))
        publish_s = time.perf_counter() - t0
        correct = [bool(t.result and t.result.correct) for t in trajectories]
        num_tokens = int(bt["lengths"].sum())
        errors = Counter(t.result.error for t in trajectories if t.result and t.result.error)
        return {
            **{f"reward/error_{kind}": count for kind, count in errors.items()},
            **finalize_metrics(summed),
            **staleness_metrics(trajectories, self.version - 1),
            "reward/mean": float(bt["rewards"].mean()),
            "reward/shaped_mean": float(rewards.mean()),
            "reward/accuracy": sum(correct) / len(correct),
            "reward/error_frac": sum(bool(t.result and t.result.error) for t in trajectories) / len(trajectories),
            "response/length_mean": num_tokens / len(trajectories),
            "response/truncated_frac": float(bt["truncated"].float().mean()),
            "time/learner_s": learner_s,
            "time/publish_s": publish_s,
            "learner/tokens_per_s": num_tokens / max(learner_s, 1e-9),
            "weights/bytes": published["num_bytes"],
            "policy_version": self.version,
        }

    def run(self) -> dict:
        cfg = self.cfg
        folder = RunFolder(cfg)
        eval_before: dict = {}
        accuracy_before = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, cfg.reward,
                                   report=eval_before)
        log.warning("held-out accuracy before training: %.3f", accuracy_before)
        run_refs = [w.run.remote() for w in self.rollout_workers]
        totals = Counter()
        bar = tqdm(range(cfg.train.steps), desc="train", dynamic_ncols=True)
        for _ in bar:
            step_start = time.perf_counter()
            groups, wait_s = self._wait_for_batch()
            metrics = self.step(groups)
            metrics["time/wait_s"] = wait_s
            metrics["time/step_s"] = time.perf_counter() - step_start
            totals.update({"wait_s": wait_s, "learner_s": metrics["time/learner_s"],
                           "publish_s": metrics["time/publish_s"], "step_s": metrics["time/step_s"]})
            if cfg.train.eval_every and self.version % cfg.train.eval_every == 0 and self.version < cfg.train.steps:
                metrics["eval/accuracy"] = self._evaluate_midway(run_refs, report=metrics)
                run_refs = [w.run.remote() for w in self.rollout_workers]
            if cfg.train.save_every and self.version % cfg.train.save_every == 0:
                self.save_checkpoint(folder.path / "checkpoints" / f"step_{self.version:06d}")
            if self.version % cfg.train.log_every == 0:
                metrics.update(ray.get(self.controller.stats.remote()))
                metrics.update(self._rollout_metrics())
                metrics.update(self.data_counts)
                folder.log(self.version, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", acc=f"{metrics['reward/accuracy']:.2f}")
        ray.get(self.controller.stop.remote())
        worker_reports = ray.get(run_refs)
        self._sync_idle_workers()
        eval_after: dict = {}
        accuracy_after = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, cfg.reward,
                                  report=eval_after)
        log.warning("held-out accuracy after training: %.3f", accuracy_after)
        self.learner.save_hf(folder.final_model_dir)
        stats = ray.get(self.controller.stats.remote())
        wall = time.perf_counter() - self.job_start
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
            "final_model": folder.final_model_dir,
        }
        folder.write_summary(summary)
        folder.close()
        return summary

    def save_checkpoint(self, path: Path) -> None:
        """The policy in HF format plus the controller's state (data cursor, queue, counters) as JSON."""
        self.learner.save_hf(str(path))
        state = {"policy_version": self.version, "controller": ray.get(self.controller.state_dict.remote())}
        (path / "controller_state.json").write_text(json.dumps(state))

    def _rollout_metrics(self) -> dict[str, float]:
        reports = ray.get(self.controller.get_worker_stats.remote())
        if not reports:
            return {}
        wall = sum(r["wall_s"] for r in reports.values())
        gen = sum(r["generate_s"] for r in reports.values())
        return {
            "rollout/idle_frac": sum(r["idle_s"] for r in reports.values()) / max(wall, 1e-9),
            "rollout/tokens_per_s": sum(r["tokens"] for r in reports.values()) / max(gen, 1e-9),
            "rollout/sync_s_total": sum(r["sync_s"] for r in reports.values()),
        }

    def _sync_idle_workers(self) -> None:
        """After the loop, bring every worker to the last published weights (for evaluation)."""
        latest = ray.get(self.controller.latest_weights.remote(-1))
        if latest is None:
            return
        versions = ray.get([w.get_version.remote() for w in self.rollout_workers])
        ray.get([w.load_weights.remote(*latest) for w, v in zip(self.rollout_workers, versions) if v < latest[0]])

    def _evaluate_midway(self, run_refs: list, report: dict | None = None) -> float:
        """Pause generation, evaluate with the newest weights, and let the caller restart the workers."""
        ray.get(self.controller.stop.remote())
        ray.get(run_refs)
        self._sync_idle_workers()
        accuracy = evaluate(self.rollout_workers, self.eval_prompts, self.reward_workers, self.cfg.reward,
                            report=report)
        ray.get(self.controller.resume.remote())
        return accuracy

    def shutdown(self) -> None:
        self.learner.shutdown()
        for actor in [*self.rollout_workers, *self.reward_workers, self.controller]:
            ray.kill(actor)
        self.placement.remove()


def train(cfg: RunConfig) -> dict:
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.shutdown()
