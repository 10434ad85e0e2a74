"""Metric names, the one rule that merges metric dicts, and the record each step writes to the run's log.

Learner ranks, rollout workers, reward workers and the controller each report plain `{name: number}` dicts;
the driver merges them here and cluster/run_folder.py writes the result to metrics.jsonl and TensorBoard.
Plain Python over the records of protocols/, so every process (actors, verifier pools, the simulator) can import
it.
"""

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping

from protocols.trajectory import TOKEN_SCORERS

MAX_SUFFIX = "_max"
"""Names ending in this merge by maximum (peak memory, the largest ratio, the slowest rank); all others add."""

SECTIONS: dict[str, str] = {
    "reward/": "the trained batch: reward/mean (verifier reward as the learner received it), reward/shaped_mean "
               "(after algorithm length shaping), reward/accuracy, reward/error_frac, reward/error_<kind> "
               "(samples of the batch whose check failed, by kind)",
    "reward_worker/": "the reward workers' own counters since the last logged step, over every group they scored "
                      "(dropped ones included): samples, error_<kind> (exception, timeout, crash, ...), "
                      "process_restarts, seconds_per_sample, reward_mean, correct_rate",
    **{f"{role}_worker/": f"the {role} workers' own counters since the last logged step: groups, samples, "
                          "micro_batches (forwards), seconds_per_group, tokens_per_s (prompt + response tokens per "
                          "second of scoring)" for role in TOKEN_SCORERS},
    "teacher/": "on-policy distillation (teacher workers), over the trained batch's loss tokens: reverse_kl_mean "
                "(log mu - log pi_teacher per sampled token), reverse_kl_p50/p90/p99, reverse_kl_q1..q4 (its mean "
                "in each quarter of a response's sampled tokens) and advantage_share (the teacher's share of the "
                "advantages' magnitude under algorithm.distillation.weight); with algorithm.distillation.top_k > 0, "
                "topk_mass (the teacher's probability on its top k) and topk_kl (the learner's forward KL from the "
                "teacher's renormalized top k, per loss token) in place of advantage_share",
    "response/": "length_mean, length_p50, length_p99, length_max (tokens, of the trained batch), truncated_frac",
    "generated/": "every sample the engines finished and the verifiers scored since the last logged step, trained "
                  "or dropped (a group all wrong or all right never reaches the batch, so response/ cannot show "
                  "what the policy writes for the problems it never solves): samples, length_mean, length_p50, "
                  "length_p99, length_max, truncated_frac",
    "staleness/": "mean, max, hist_<lag> (share of samples lag versions old), mixed_version_frac",
    "tools/": "tool-using rollouts (only with tools enabled), over the trained batch: turns_per_sample, "
              "calls_per_sample, call_rate (share of samples with a call), errors_<kind> (calls: unknown_tool, "
              "exception, timeout), seconds_mean (per call), token_share (tool tokens / response tokens), "
              "truncated_outputs, malformed_calls, max_turns_share",
    "queue/": "the controller's replay queue: depth, admitted, received, trained, in_flight, leased, "
              "dropped_<reason>, zero_variance_rewarded (the groups of dropped_zero_variance whose samples were all "
              "rewarded: too easy; the others earned nothing: too hard)",
    "control/": "controller calls by method (calls_<method>)",
    "autoscale/": "the rollout autoscaler's decision after each step (rollout.autoscale): size, change (+1, -1, 0), "
                  "wait_frac (the share of the step the learner waited) and reason_<why> = 1 for its reason",
    "rollout/": "idle_frac, tokens_per_s, sync_s_total over the rollout workers; num_workers (the pool's size, "
                "which `relayrl scale` changes while the job runs); prefix_cache_hit_rate and prefill_tokens_saved "
                "(rollout.prefix_caching, actors/prefix_cache.py)",
    "gateway/": "the session endpoint's counters (gateway.enabled), summed over the rollout workers since the run "
                "started: sessions, sessions_rewarded, sessions_no_reward, sessions_lost, calls, calls_refused, "
                "calls_lost, calls_undelivered, calls_replayed, calls_busy, fields_refused, clamped_max_tokens, "
                "tool_parse_failures, retries, staleness_cuts, samples, groups_opened, groups (trained), "
                "groups_wrong_size, groups_untrained, groups_incomplete, groups_open, open_sessions, "
                "splits_<reason>, ...; "
                "calls_per_session, samples_per_rewarded_session; with rollout.prefix_caching "
                "prefill_tokens_saved_per_session and prefix_cache_hit_rate; with gateway.agent the in-process agent's "
                "agent_runs, agent_rewards, agent_no_reward, agent_errors, agent_timeouts, agent_bad_rewards, "
                "agent_groups, agent_groups_refused, agent_groups_after_stop (gateway/agent_runner.py)",
    "time/": "seconds per phase of the step: wait_s, learner_s, publish_s, step_s, verify_s (the weight-sync "
             "check: the learner's probe forward and the comparison)",
    "learner/": "the learner's own readings: tokens_per_s, real/processed tokens, effective_token_frac, "
                "micro_batches_max, peak_gib_max",
    "weights/": "bytes published per version; the weight-sync check (weight_sync.verify_every): verify_checks "
                "(engine loads compared with the learner so far) and verify_max_gap (the largest |engine - learner| "
                "probe log-prob of the checks compared at this step)",
    "eval/": "held-out evaluation: eval/accuracy (greedy, the run's test split), eval/<set>/accuracy, "
             "eval/<set>/pass@<k>, eval/<set>/samples, eval/<set>/error_<kind> for each train.eval_sets entry",
    "data/": "loader counts (loaded, skipped_too_long, eval_overlap_skipped) and the controller's data epoch; "
             "with a mixture (data.tasks) drawn_<source>, the prompts drawn from each source so far",
    "source/": "a mixture's sources (data.tasks), each over its samples of the trained batch: "
               "source/<source>/share (its share of the batch's samples), reward_mean, accuracy, length_mean, "
               "calls_per_sample (tool calls), staleness_mean",
    "critic/": "the critic group's update (ppo): value_loss, value_clip_frac, values_mean, returns_mean, "
               "explained_variance, grad_norm_max, lr, version, seconds_max, skipped_nonfinite (updates skipped "
               "after a NaN or infinite loss, as learner/skipped_nonfinite), update_lost (an update lost with a dead "
               "critic rank)",
    "fault/": "the supervisor's counts since the run started: replaced_<role> (rollout, reward, reference, critic "
              "workers replaced after they died), start_failures_<role> (new workers of a resize that did not "
              "start: an engine error, or no room on the cluster in time) and resent_publishes (weight broadcasts "
              "sent again after a rollout engine died in the collective)",
}
"""Every name with a `/` belongs to one of these sections. Names without one are the objective's own
(loss, pg_loss, kl, entropy, clip_frac*, ratio_*, is_*, grad_norm_max, num_tokens, policy_version, ...;
see learner/objective.py finalize_metrics)."""


def source_metrics(trajectories: list, version: int) -> dict[str, float]:
    """source/<source>/*: the trained batch split by each sample's `prompt.metadata.data_source` (a mixture's
    task), beside the totals; {} when no sample names a source. `version`: the policy version the batch trains at
    (staleness is version minus each sample's oldest token's)."""
    by_source: dict[str, list] = {}
    for t in trajectories:
        source = t.prompt.metadata.get("data_source")
        if source is not None:
            by_source.setdefault(str(source), []).append(t)
    out: dict[str, float] = {}
    for source, samples in sorted(by_source.items()):
        n = len(samples)
        prefix = f"source/{source}/"
        out[prefix + "share"] = n / len(trajectories)
        out[prefix + "reward_mean"] = sum(t.reward for t in samples) / n
        out[prefix + "accuracy"] = sum(bool(t.result and t.result.correct) for t in samples) / n
        out[prefix + "length_mean"] = sum(len(t.response_token_ids) for t in samples) / n
        out[prefix + "calls_per_sample"] = sum(len(t.tool_calls or ()) for t in samples) / n
        out[prefix + "staleness_mean"] = sum(version - t.version_span[0] for t in samples) / n
    return out


def length_metrics(lengths: list[int], prefix: str = "response/") -> dict[str, float]:
    """Median, 99th percentile (nearest rank) and longest of `lengths` (tokens): a long tail shows in p99 and max
    long before it moves the mean."""
    ordered = sorted(lengths)

    def rank(q: float) -> float:
        return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {f"{prefix}length_p50": rank(0.5), f"{prefix}length_p99": rank(0.99), f"{prefix}length_max": rank(1.0)}


def merges_by_max(name: str) -> bool:
    return name.endswith(MAX_SUFFIX)


def combine_metrics(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Merge metric dicts of several micro-batches, ranks or workers: `_max` names take the maximum, all others
    add (so they must be sums or counts; turn them into means after merging)."""
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif merges_by_max(key):
                out[key] = max(out[key], value)
            else:
                out[key] += value
    return out


def unknown_names(metrics: Iterable[str]) -> list[str]:
    """Names with a section prefix that SECTIONS does not list (a typo, or a section to document there)."""
    return [name for name in metrics if "/" in name and not any(name.startswith(s) for s in SECTIONS)]


# ----- reward workers -----------------------------------------------------------------------------------------
REWARD_WORKER_ERRORS = ("exception", "timeout", "crash")
"""Error kinds always reported (0 when none happened); others a verifier or the scorer adds appear as they occur."""


def reward_worker_metrics(counters: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """`reward_worker/*` from the raw counters of one or more reward workers (Scorer.counters(): samples,
    error_<kind>, restarts, verify_time_s, reward_sum, correct), merged first so means are weighted by samples."""
    c = Counter(combine_metrics(counters))
    n = c["samples"]
    kinds = sorted(set(REWARD_WORKER_ERRORS) | {k[len("error_"):] for k in c if k.startswith("error_")})
    return {
        "reward_worker/samples": n,
        **{f"reward_worker/error_{kind}": c[f"error_{kind}"] for kind in kinds},
        "reward_worker/process_restarts": c["restarts"],
        "reward_worker/seconds_per_sample": c["verify_time_s"] / n if n else 0.0,
        # the scorer's reward (verifier plus reward.shaping), before the learner's length shaping
        "reward_worker/reward_mean": c["reward_sum"] / n if n else 0.0,
        "reward_worker/correct_rate": c["correct"] / n if n else 0.0,
    }


# ----- reference workers ---------------------------------------------------------------------------------------
def reference_worker_metrics(counters: Iterable[Mapping[str, float]], prefix: str = "reference_worker") \
        -> dict[str, float]:
    """`reference_worker/*` from the raw counters of one or more reference workers (ReferenceWorker.counters():
    groups, samples, tokens, micro_batches, seconds), merged first so rates are weighted by work. Every frozen
    token scorer's workers (protocols.trajectory.TOKEN_SCORERS) count the same things, under `<role>_worker/`."""
    c = Counter(combine_metrics(counters))
    return {
        f"{prefix}/groups": c["groups"],
        f"{prefix}/samples": c["samples"],
        f"{prefix}/micro_batches": c["micro_batches"],
        f"{prefix}/seconds_per_group": c["seconds"] / c["groups"] if c["groups"] else 0.0,
        # tokens through the model (prompt + response) per second of scoring, summed over the workers' time
        f"{prefix}/tokens_per_s": c["tokens"] / c["seconds"] if c["seconds"] else 0.0,
    }


# ----- rollout workers and the batch --------------------------------------------------------------------------
def rollout_metrics(reports: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """`rollout/*` from the rollout workers' reports (wall_s, generate_s, idle_s, tokens, sync_s each)."""
    total = combine_metrics({k: r[k] for k in ("wall_s", "generate_s", "idle_s", "tokens", "sync_s")}
                            for r in reports)
    if not total:
        return {}
    out = {
        "rollout/idle_frac": total["idle_s"] / max(total["wall_s"], 1e-9),
        "rollout/tokens_per_s": total["tokens"] / max(total["generate_s"], 1e-9),
        "rollout/sync_s_total": total["sync_s"],
    }
    cached = [r for r in reports if "prefill_tokens" in r]  # rollout.prefix_caching (actors/prefix_cache.py)
    if cached:
        prefill, saved = sum(r["prefill_tokens"] for r in cached), sum(r["cached_tokens"] for r in cached)
        out["rollout/prefix_cache_hit_rate"] = saved / max(prefill, 1)
        out["rollout/prefill_tokens_saved"] = float(saved)
    return out


def gateway_metrics(reports: Iterable[Mapping]) -> dict[str, float]:
    """`gateway/*` from the rollout workers' reports that carry a session endpoint's counters (`gateway`, see
    gateway/sessions.py COUNTER_NAMES): each counter summed over the workers, since the run started, plus
    `gateway/calls_per_session` (calls served per session opened) and `gateway/samples_per_rewarded_session`
    (training samples per session with a reward: above 1 where episodes split). {} without an endpoint."""
    counters = [r["gateway"] for r in reports if isinstance(r.get("gateway"), Mapping)]
    if not counters:
        return {}
    total = {name: float(sum(c.get(name, 0) for c in counters)) for name in counters[0]}
    out = {f"gateway/{name}": value for name, value in total.items()}
    out["gateway/calls_per_session"] = total.get("calls", 0.0) / max(total.get("sessions", 0.0), 1.0)
    out["gateway/samples_per_rewarded_session"] = (total.get("samples", 0.0)
                                                   / max(total.get("sessions_rewarded", 0.0), 1.0))
    cached = [r for r in reports if isinstance(r.get("gateway"), Mapping) and "gateway_cached_tokens" in r]
    if cached:  # rollout.prefix_caching: the prefill a session's later calls did not repeat
        saved = sum(r["gateway_cached_tokens"] for r in cached)
        out["gateway/prefill_tokens_saved_per_session"] = saved / max(total.get("sessions", 0.0), 1.0)
        out["gateway/prefix_cache_hit_rate"] = saved / max(sum(r["gateway_prefill_tokens"] for r in cached), 1)
    return out


# ----- held-out evaluation ------------------------------------------------------------------------------------
def eval_metrics(set_name: str, result: Mapping) -> dict[str, float]:
    """`eval/<set>/*` from an evaluation result (cluster/evaluation.py EvalResult.summary())."""
    out = {f"eval/{set_name}/accuracy": result["greedy_accuracy"], f"eval/{set_name}/samples": result["prompts"]}
    out.update({f"eval/{set_name}/pass@{k}": v for k, v in result["pass_at_k"].items()})
    out.update({f"eval/{set_name}/error_{kind}": n for kind, n in result["errors"].items()})
    return out


# ----- the run's log ------------------------------------------------------------------------------------------
def log_record(step: int, metrics: Mapping[str, object]) -> str:
    """One metrics.jsonl line: `step` first, numbers as floats (NaN stays NaN: Python's json reads it back)."""
    clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
    return json.dumps({"step": step, **clean})


def scalars(metrics: Mapping[str, object]) -> dict[str, float]:
    """The finite numbers of a step, for TensorBoard (which cannot plot NaN or text)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and math.isfinite(float(v))}
