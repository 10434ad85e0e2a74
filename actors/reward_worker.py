"""Reward worker: a Ray actor that scores trajectory groups on their way to the replay queue (the controller's
scoring stage sends it each group's ref, actors/scoring_stage.py), and held-out responses for evaluation. A thin wrapper around `rewards.scorer.Scorer`, which
holds the logic and is tested without Ray. The driver creates `reward.num_workers` of them with
`ray.remote(RewardWorker).options(num_cpus=...)`; `score_on_workers` spreads an evaluation over them.
"""

import logging
from collections import Counter

from protocols.reward import RewardConfig
from protocols.trajectory import Prompt, TrajectoryGroup, VerifierResult
from rewards.scorer import Scorer

log = logging.getLogger(__name__)
# Slack on top of the per-sample limits for a whole evaluation chunk (process start, Ray transfer).
_EVAL_SLACK_S = 60.0


class RewardWorker:
    def __init__(self, cfg: RewardConfig, worker_index: int):
        self.worker_index = worker_index
        self.scorer = Scorer(cfg)

    def score_group(self, group: TrajectoryGroup) -> tuple[list[float], list[VerifierResult]]:
        """Each sample's reward and verifier result, in order: only the new numbers travel back, not the group. A
        failed check gives reward 0, never an exception."""
        scored = self.scorer.score_group(group)
        return [t.reward for t in scored.trajectories], [t.result for t in scored.trajectories]

    def score_groups(self, *groups: TrajectoryGroup) -> list[tuple[list[float], list[VerifierResult]]]:
        """`score_group` of each of a batch's groups, in order (the scoring stage's call: one task per hand-over)."""
        return [self.score_group(group) for group in groups]

    def score_held_out(self, prompts: list[Prompt], responses: list[str]) -> list[VerifierResult]:
        """Held-out scoring with the run's verifier, per-prompt verifiers, settings and limits. A failed check is
        `correct=False` with `error` set; these samples stay out of `metrics()` (they are not training data)."""
        return self.scorer.score(prompts, responses, count=False)

    def metrics(self) -> dict[str, float]:
        """`reward_worker/*` since the last call (samples, errors by kind, seconds per sample, ...)."""
        return self.scorer.metrics()

    def counters(self) -> dict[str, float]:
        """Raw counts since the last call, for merging over workers (protocols.metrics.reward_worker_metrics)."""
        return self.scorer.counters()

    def ping(self) -> int:
        return self.worker_index

    def shutdown(self) -> None:
        self.scorer.close()


def score_on_workers(reward_workers: list, prompts: list[Prompt], responses: list[str],
                     cfg: RewardConfig) -> tuple[list[bool], Counter]:
    """(correct per response, error counts by kind) for held-out responses, spread over the reward worker
    actors. Never raises for a verifier's or a worker's failure: a verifier exception, timeout or crash, a
    worker that died (`worker_died`) or did not answer in time (`worker_timeout`) counts as wrong."""
    results = results_on_workers(reward_workers, prompts, responses, cfg)
    return [r.correct for r in results], Counter(r.error for r in results if r.error)


def results_on_workers(reward_workers: list, prompts: list[Prompt], responses: list[str],
                       cfg: RewardConfig) -> list[VerifierResult]:
    """One VerifierResult per held-out response (reward, correct, the verifier's `info` with the extracted
    answer, error kind), spread over the reward worker actors. A worker that died or did not answer in time
    gives its samples `correct=False` with error `worker_died` / `worker_timeout`; never raises for them."""
    import ray

    if not reward_workers:
        raise ValueError("held-out evaluation needs at least one reward worker (reward.num_workers >= 1)")
    n = len(reward_workers)
    chunks = [list(range(i, len(prompts), n)) for i in range(n)]
    refs = [w.score_held_out.remote([prompts[j] for j in c], [responses[j] for j in c])
            for w, c in zip(reward_workers, chunks) if c]  # fmt: skip
    results: list[VerifierResult | None] = [None] * len(prompts)
    for ref, chunk in zip(refs, [c for c in chunks if c]):
        # Every sample is bounded by reward.timeout_s plus the scorer's kill grace; samples run one after another
        # in the worst case.
        limit = len(chunk) * (cfg.timeout_s + 3.0) + _EVAL_SLACK_S
        failure = ""
        try:
            scored = ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            log.warning("a reward worker gave no held-out scores within %.0f s; its %d samples count as wrong",
                        limit, len(chunk))
            failure = "worker_timeout"
        except ray.exceptions.RayError as err:
            log.warning("a reward worker failed during held-out evaluation (%s); its %d samples count as wrong",
                        type(err).__name__, len(chunk))
            failure = "worker_died"
        if failure:
            scored = [VerifierResult(reward=0.0, correct=False, info={"error": failure}, error=failure)] * len(chunk)
        for j, result in zip(chunk, scored, strict=True):
            results[j] = result
    return results  # type: ignore[return-value]
