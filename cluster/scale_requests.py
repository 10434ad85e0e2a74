"""Asking a running job to resize its rollout pool: `relayrl scale RUN_DIR --rollout-workers N` (or
`request_scale` from Python) writes a request into the run folder, and the driver applies it between two steps
(`ScaleInbox.take`, then the pool's `resize`) and writes back what it did.

A file in the run folder, not a Ray call, so that the same command works for a job started by `relayrl train` and
for one submitted with `ray job submit` (the run folder is shared by every node that writes checkpoints; the
command needs no connection to the cluster). Pure: no Ray.

    RUN_DIR/control/scale_request.json  {"id": 3, "rollout": 4}          written by the command (atomic rename)
    RUN_DIR/control/scale_done.json     {"id": 3, "rollout": 4, ...}     written by the driver once applied
    RUN_DIR/control/driver.json         {"pid", "host", "beat_at"}       the driver's heartbeat while its loop runs

A job is running when its heartbeat is fresh: the driver rewrites driver.json every HEARTBEAT_S seconds from a
thread of its own (so a long step does not make it look dead) and removes it when its training loop ends. The
command refuses a folder without one, or with one older than STALE_S (a driver that was killed), instead of
leaving a request nobody will apply.
"""

import json
import operator
import os
import socket
import threading
import time
from pathlib import Path

REQUEST = "scale_request.json"
DONE = "scale_done.json"
HEARTBEAT = "driver.json"
HEARTBEAT_S = 5.0
"""Seconds between two heartbeats of a running driver."""
STALE_S = 60.0
"""A heartbeat older than this means the driver stopped (12 missed beats: margin for a loaded node and for clocks
of two nodes sharing the run folder that differ by some seconds)."""
ROLES = ("rollout",)
"""Roles a request may resize (the pools with `resize`; the critic's ranks train as one and do not resize)."""


def check_size(role: str, n) -> int:
    """`n` as a pool size, or ValueError naming it and the fix: a whole number of workers, at least one (a running
    job keeps every role it started with). Runs before anything changes, so a refused size leaves the pool as it
    was."""
    if isinstance(n, bool) or not isinstance(n, int):
        try:
            if isinstance(n, bool):
                raise TypeError
            n = operator.index(n)  # numpy integers and the like
        except TypeError:
            raise ValueError(f"{role} pool resize to {n!r}: a size is a whole number of workers, got "
                             f"{type(n).__name__}; give an integer >= 1, e.g. 2") from None
    if n < 1:
        raise ValueError(f"{role} pool resize to {n}: a running job keeps at least one {role} worker; give 1 or more "
                         "(to end the job, stop its driver)")
    return int(n)


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


def check_running(run_dir: str | Path, now: float | None = None) -> dict:
    """The heartbeat of the driver writing `run_dir`, or ValueError saying why no job runs there and what to do."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a run folder (no config.yaml): give the output_dir of a running "
                         "`relayrl train` job")
    beat = _read(_control(run_dir) / HEARTBEAT)
    if beat is None:
        if (run_dir / "summary.json").is_file():
            raise ValueError(f"the run in {run_dir} has finished (summary.json written): there is no job to resize. "
                             f"To go on training it, `relayrl train --resume {run_dir} rollout.num_workers=N`")
        raise ValueError(f"no job is running in {run_dir}: its driver writes {HEARTBEAT} in control/ while the "
                         "job runs, and there is none (not started yet, or stopped). Start or "
                         f"resume it (`relayrl train --resume {run_dir}`), then scale")
    age = (time.time() if now is None else now) - beat.get("beat_at", 0.0)
    if age > STALE_S:
        raise ValueError(f"the job in {run_dir} is not running: its driver (pid {beat.get('pid')} on "
                         f"{beat.get('host')}) last wrote its heartbeat {age:.0f} s ago (it beats every "
                         f"{HEARTBEAT_S:g} s; older than {STALE_S:g} s means it stopped: killed or crashed). Resume "
                         f"it with `relayrl train --resume {run_dir} rollout.num_workers=N`")
    return beat


def request_scale(run_dir: str | Path, rollout: int) -> int:
    """Ask the job writing `run_dir` for `rollout` rollout workers. Returns the request's id (to wait for with
    `wait_done`). Raises naming the fix when `run_dir` is not a run folder, no job runs there (`check_running`)
    or the size is not a whole number of at least one."""
    run_dir = Path(run_dir)
    try:
        check_size("rollout", rollout)
    except ValueError as err:
        raise ValueError(f"--rollout-workers={rollout!r}: {str(err).split(': ', 1)[1]}") from None
    check_running(run_dir)
    control = _control(run_dir)
    control.mkdir(exist_ok=True)
    last = max((r or {}).get("id", 0) for r in (_read(control / REQUEST), _read(control / DONE)))
    request_id = last + 1
    _write_atomic(control / REQUEST, {"id": request_id, "rollout": rollout, "requested_at": time.time()})
    return request_id


def wait_done(run_dir: str | Path, request_id: int, timeout_s: float, poll_s: float = 0.2) -> dict | None:
    """The driver's record of request `request_id` (or a later one), or None after `timeout_s`. Raises
    `check_running`'s ValueError as soon as the driver stops beating (it crashed, was killed or finished): no
    record would come, so waiting on would only run out the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = _read(_control(run_dir) / DONE)
        if done is not None and done.get("id", 0) >= request_id:
            return done
        check_running(run_dir)
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


class DriverHeartbeat:
    """The driver's side of `check_running`: a daemon thread rewrites control/driver.json every HEARTBEAT_S
    seconds from `start()` to `stop()`, which removes it. A context manager."""

    def __init__(self, run_dir: str | Path, interval_s: float = HEARTBEAT_S) -> None:
        self.path = _control(run_dir) / HEARTBEAT
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="relayrl-heartbeat", daemon=True)

    def _write(self) -> None:
        _write_atomic(self.path, {"pid": os.getpid(), "host": socket.gethostname(), "beat_at": time.time()})

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError:  # a shared folder that blinked: the next beat tries again
                pass

    def start(self) -> "DriverHeartbeat":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()  # at once: a scale right after the loop starts finds the job running
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "DriverHeartbeat":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
