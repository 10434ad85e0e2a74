"""What an agent program outside the run reads to find the session endpoints, and what the driver says while it
waits for their groups (gateway.enabled). Each rollout worker writes `RUN/gateway/worker-<id>.json` when its
endpoint binds; the driver gathers them into `RUN/gateway/endpoints.json` with a `ready` flag: true while the
workers' run loops serve calls, false around evaluations and once the run has finished (`finished: true`).

With gateway.outside_only a step's groups come only from outside agents, so a wait names that setting and the
sessions the endpoints have seen: a run nobody feeds says so in its log, then in its timeout error."""

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from protocols.config import RunConfig

ENDPOINTS_FILE = "endpoints.json"


def worker_file(run_dir: str | Path, worker_id: int) -> Path:
    """Where rollout worker `worker_id` writes its endpoint's address (gateway/service.py)."""
    return Path(run_dir) / "gateway" / f"worker-{worker_id}.json"


def write_endpoints(cfg: RunConfig, worker_ids: Iterable[int], ready: bool, policy_version: int,
                    finished: bool = False) -> Path:
    """Write `RUN/gateway/endpoints.json` whole (a reader never sees half a file): the endpoints of `worker_ids`
    as their workers wrote them, whether they serve calls now, the weights' version, and what a group needs."""
    folder = Path(cfg.output_dir) / "gateway"
    folder.mkdir(parents=True, exist_ok=True)
    workers = []
    for worker_id in worker_ids:
        path = worker_file(cfg.output_dir, worker_id)
        if path.is_file():
            workers.append(json.loads(path.read_text()))
    data = {"ready": ready and not finished, "finished": finished, "outside_only": cfg.gateway.outside_only,
            "policy_version": policy_version, "group_size": cfg.rollout.samples_per_prompt,
            "groups_per_step": cfg.learner.prompts_per_step, "session_timeout_s": cfg.gateway.session_timeout_s,
            "max_calls_in_flight": cfg.gateway.max_calls_in_flight,
            "workers": workers}
    target = folder / ENDPOINTS_FILE
    temporary = folder / f".{ENDPOINTS_FILE}.{os.getpid()}"
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, target)
    return target


def session_totals(worker_stats: Mapping[int, Mapping]) -> dict[str, float]:
    """The endpoints' counters (gateway/sessions.py COUNTER_NAMES) summed over the rollout workers' last reports."""
    total: dict[str, float] = {}
    for report in worker_stats.values():
        for name, value in (report.get("gateway") or {}).items():
            if isinstance(value, (int, float)):
                total[name] = total.get(name, 0) + value
    return total


def waiting_line(cfg: RunConfig, version: int, waited_s: float, queue: Mapping[str, float],
                 sessions: Mapping[str, float]) -> str:
    """The log line of a wait for the batch of `version`: what is queued and in flight and, with
    gateway.outside_only, what the outside agents have done so far."""
    line = (f"waiting {waited_s:.0f} s for the batch of policy version {version}: "
            f"{queue.get('queue/depth', 0):.0f} of {cfg.learner.prompts_per_step} groups queued, "
            f"{queue.get('queue/in_flight', 0):.0f} in flight")
    if not cfg.gateway.outside_only:
        return line
    return (f"{line}; gateway.outside_only=true: only groups of sessions that outside agents open train. "
            f"{_sessions_said(sessions)}. Agents find the endpoints in "
            f"{Path(cfg.output_dir) / 'gateway' / ENDPOINTS_FILE}")


def stall_message(cfg: RunConfig, version: int, queue: Mapping[str, float], sessions: Mapping[str, float]) -> str:
    """The error of a wait that ran out (fault.batch_timeout_s): the leased run's, or the outside-only run's, which
    says what its agents did and what a group needs."""
    fault = cfg.fault
    if not cfg.gateway.outside_only:
        return (f"no training batch for policy version {version} within fault.batch_timeout_s="
                f"{fault.batch_timeout_s} (queue depth {queue.get('queue/depth', 0):.0f}, in flight "
                f"{queue.get('queue/in_flight', 0):.0f}, every worker alive); raise it if generation is that slow")
    return (f"no training batch for policy version {version} within fault.batch_timeout_s={fault.batch_timeout_s}: "
            f"gateway.outside_only=true trains only groups of sessions that outside agents open, and "
            f"{_sessions_said(sessions)}. A step takes learner.prompts_per_step={cfg.learner.prompts_per_step} groups "
            f"of rollout.samples_per_prompt={cfg.rollout.samples_per_prompt} rewarded sessions each (POST /sessions "
            f"with the same `group` key, then POST /sessions/ID/reward). Point an agent at the endpoints in "
            f"{Path(cfg.output_dir) / 'gateway' / ENDPOINTS_FILE} (docs/agents.md, demos/outside_agent.py), or "
            f"raise fault.batch_timeout_s if your agents are that slow")


def _sessions_said(sessions: Mapping[str, float]) -> str:
    def n(name: str) -> int:
        return int(sessions.get(name, 0))

    return (f"{n('sessions')} sessions were opened ({n('sessions_rewarded')} rewarded, {n('sessions_no_reward')} "
            f"finished without a reward, {n('sessions_lost')} lost a call, {n('open_sessions')} open); "
            f"{n('groups')} groups went to training, {n('groups_wrong_size')} had the wrong number of samples, "
            f"{n('groups_untrained')} had no rewarded session, {n('groups_incomplete')} never filled, "
            f"{n('groups_open')} are forming")
