"""A `relayrl train` driver run as a separate process in its own session, and killing that whole session.

This is how the resume test (tests/test_resume.py) and the fault-injection benchmark
(benchmarks/fault_injection.py) lose a driver the way a crashed machine would: SIGKILL to the driver, its
embedded Ray and every actor it started, with no chance to clean up.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def launch_train(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m cli.main train ARGS` from the repository, in a new session, its output written to `log`.
    `env` adds to this process's environment."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "cli.main", "train", *args], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver's process group, then any process still in its session (what it started: Ray's raylet,
    workers, actors)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    listing = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout.splitlines()
    for pid, sid in (line.split() for line in listing if line.strip()):
        if int(sid) == proc.pid:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
