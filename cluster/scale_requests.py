"""Asking a running job to resize its rollout pool: `relayrl scale RUN_DIR --rollout-workers N` (or
`request_scale` from Python) writes a request into the run folder, and the driver applies it between two steps
(`ScaleInbox.take`, then the pool's `resize`) and writes back what it did.

A file in the run folder, not a Ray call, so that the same command works for a job started by `relayrl train` and
for one submitted with `ray job submit` (the run folder is shared by every node that writes checkpoints; the
command needs no connection to the cluster). Pure: no Ray.

    RUN_DIR/control/scale_request.json  {"id": 3, "rollout": 4}          written by the command (atomic rename)
    RUN_DIR/control/scale_done.json     {"id": 3, "rollout": 4, ...}     written by the driver once applied
"""

import json
import os
import time
from pathlib import Path

REQUEST = "scale_request.json"
DONE = "scale_done.json"
ROLES = ("rollout",)
"""Roles a request may resize (the pools with `resize`; the critic's ranks train as one and do not resize)."""


def _control(run_dir: str | Path) -> Path:
    return Path(run_dir) / "control"


def _write_atomic(path: Path, record: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def request_scale(run_dir: str | Path, rollout: int) -> int:
    """Ask the job writing `run_dir` for `rollout` rollout workers. Returns the request's id (to wait for with
    `wait_done`). Raises naming the fix when `run_dir` is not a run folder or the size is not positive."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a run folder (no config.yaml): give the output_dir of a running "
                         "`relayrl train` job")
    if rollout < 1:
        raise ValueError(f"--rollout-workers={rollout}: a running job keeps at least one rollout worker")
    control = _control(run_dir)
    control.mkdir(exist_ok=True)
    last = max((r or {}).get("id", 0) for r in (_read(control / REQUEST), _read(control / DONE)))
    request_id = last + 1
    _write_atomic(control / REQUEST, {"id": request_id, "rollout": rollout, "requested_at": time.time()})
    return request_id


def wait_done(run_dir: str | Path, request_id: int, timeout_s: float, poll_s: float = 0.2) -> dict | None:
    """The driver's record of request `request_id` (or a later one), or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = _read(_control(run_dir) / DONE)
        if done is not None and done.get("id", 0) >= request_id:
            return done
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


class ScaleInbox:
    """The driver's side: `take()` returns a request not yet applied, once; `done()` records the result."""

    def __init__(self, run_dir: str | Path) -> None:
        self.control = _control(run_dir)
        done = _read(self.control / DONE)
        self.applied = done.get("id", 0) if done else 0
        """The newest request id applied (a resumed job does not apply an old request again)."""

    def take(self) -> dict | None:
        """The newest request not yet applied ({"id", "rollout"}), or None. Cheap: one stat when nothing is new."""
        request = _read(self.control / REQUEST)
        if request is None or request.get("id", 0) <= self.applied:
            return None
        self.applied = request["id"]
        return request

    def done(self, request: dict, **result) -> None:
        """Record what the driver did with `request` (`rollout`: the pool's size now; `error`: why it refused)."""
        _write_atomic(self.control / DONE, {**request, **result, "applied_at": time.time()})
