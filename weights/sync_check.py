"""The driver's side of the weight-sync check (`weight_sync.verify_every`): the learner's log-probs of the probe
at each checked version, compared with what each rollout engine scored after it loaded that version.

Trainer.step publishes a version, has the learner score the probe (`learner_batch` -> LearnerGroup.probe_logprobs
-> `record_learner`), and compares the engines' results that came with their reports since (`compare`). The
engines score the probe inside their decode steps (actors/weight_probe_requests.py) and report it with their
controller calls, so the check adds no call to a worker. A gap above the tolerance stops the run. Pure.
"""

from collections import OrderedDict

from protocols.training_batch import TrainingBatch
from protocols.weight_probe import ProbeGap, check_probe_fits, probe_gap, run_probe

KEEP_VERSIONS = 64
"""Learner results kept: an engine's result for an older version (it was that far behind) is not compared."""


class WeightSyncMismatch(RuntimeError):
    """A rollout engine's log-probs of the probe differ from the learner's at the same version by more than
    weight_sync.verify_tolerance: the engine does not hold the weights the learner published."""


class WeightCheck:
    def __init__(self, cfg, vocab_size: int, context_tokens: int) -> None:
        """`vocab_size`: the tokenizer's (the engines build the same probe from theirs); `context_tokens`: the
        engines' context, which the probe must fit (refused here, before any actor starts)."""
        ws = cfg.weight_sync
        self.every = ws.verify_every
        self.tolerance = ws.check_tolerance(cfg.model.dtype)
        self.tolerance_source = (f"weight_sync.verify_tolerance={ws.verify_tolerance}"
                                 if ws.verify_tolerance is not None else f"the default for model.dtype={cfg.model.dtype}")
        self.probe = run_probe(cfg, vocab_size)
        check_probe_fits(self.probe, context_tokens)
        self.learner_logprobs: OrderedDict[int, list[list[float]]] = OrderedDict()
        self.compared: set[tuple[int, int]] = set()
        """(worker id, version) pairs already compared (a worker reports its last results every call)."""
        self.checks = 0
        self.max_gap = 0.0
        """The largest gap of the run so far."""
        self._step_gaps: list[float] = []

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def learner_batch(self, num_groups: int) -> TrainingBatch:
        """The probe as a batch for the learner, its sequences repeated to a multiple of the learner's
        data-parallel groups (every group gets samples); `record_learner` keeps the first rows."""
        n = len(self.probe.prompt_ids)
        total = -(-n // num_groups) * num_groups
        prompts = [list(self.probe.prompt_ids[i % n]) for i in range(total)]
        responses = [list(self.probe.response_ids[i % n]) for i in range(total)]
        return TrainingBatch.from_samples(prompts, responses)

    def record_learner(self, version: int, rows: list[list[float]]) -> None:
        """The learner's log-probs of the probe's response tokens at `version` (rows beyond the probe's dropped)."""
        self.learner_logprobs[version] = rows[: len(self.probe.prompt_ids)]
        while len(self.learner_logprobs) > KEEP_VERSIONS:
            self.learner_logprobs.popitem(last=False)

    def compare(self, worker_id: int, results: list[dict]) -> list[ProbeGap]:
        """Compare a worker's probe results ({version, digest, logprobs}) not compared yet with the learner's at the
        same version. Raises WeightSyncMismatch naming the version, the worker, the gap and the setting."""
        gaps = []
        for result in results:
            version = result["version"]
            if (worker_id, version) in self.compared or version not in self.learner_logprobs:
                continue
            self.compared.add((worker_id, version))
            if result["digest"] != self.probe.digest:
                raise RuntimeError(
                    f"rollout worker {worker_id} scored a different weight-sync probe (digest {result['digest']}) "
                    f"than the driver built ({self.probe.digest}): its tokenizer has another size than the one in "
                    "model.path. Both sides build it from weight_sync.verify_* and the tokenizer")
            gap = probe_gap(result["logprobs"], self.learner_logprobs[version])
            self.checks += 1
            self.max_gap = max(self.max_gap, gap.max_gap)
            self._step_gaps.append(gap.max_gap)
            gaps.append(gap)
            if not gap.max_gap <= self.tolerance:
                raise WeightSyncMismatch(
                    f"weight sync check failed at policy version {version}: rollout worker {worker_id}'s log-probs "
                    f"of the probe differ from the learner's by up to {gap.max_gap:.4g} nats (mean {gap.mean_gap:.3g}; "
                    f"sequence {gap.sequence}, token {gap.token}), above the tolerance {self.tolerance:g} "
                    f"({self.tolerance_source}). The engine does not hold the weights the learner published: a "
                    "tensor missing or stale in the load (weight_sync.type and the vLLM version are the first "
                    "suspects; see docs/weight_sync.md). If this gap is the hardware's rounding, raise "
                    "weight_sync.verify_tolerance; weight_sync.verify_every=0 turns the check off")
        return gaps

    def compare_reports(self, reports: dict[int, dict]) -> None:
        """`compare` every worker's results in its latest report (the controller's get_worker_stats)."""
        for worker_id, report in reports.items():
            self.compare(worker_id, report.get("weight_probes", []))

    def metrics(self) -> dict[str, float]:
        """`weights/verify_checks` (the run's count so far) and, when this step compared any,
        `weights/verify_max_gap` (the largest of them)."""
        out = {"weights/verify_checks": float(self.checks)}
        if self._step_gaps:
            out["weights/verify_max_gap"] = max(self._step_gaps)
            self._step_gaps = []
        return out
