"""The `ray job submit` recipe for real: a local `ray start --head` cluster of our own, the demo job submitted
through deploy/ray_job_submit.sh, its summary read back. Only the cluster this test started is stopped."""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
              "--node-manager-port", "--object-manager-port")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_for_dashboard(url: str, head: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answered; 401 when the cluster uses Ray's token authentication (~/.ray/auth_token)
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the dashboard at {url} did not answer in {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop_head(head: subprocess.Popen, temp_dir: str) -> list[str]:
    """Kill the process group of our `ray start` only; return the command lines of our processes left."""
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        try:
            head.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    time.sleep(2)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in ps if temp_dir in line]


def test_submitted_demo_job_writes_its_summary(tmp_path):
    venv_bin = Path(sys.executable).parent
    ports = free_ports(len(PORT_FLAGS))
    flags = [str(x) for flag, port in zip(PORT_FLAGS, ports) for x in (flag, port)]
    # Short path: Ray's Unix sockets live under it and socket paths are limited to 107 characters.
    temp_dir = tempfile.mkdtemp(prefix="rrjob", dir="/tmp")
    # Token authentication on, with a token of this test's own: the cluster, `ray job submit` and the job's
    # driver all read it from the environment, whatever ~/.ray/auth_token holds.
    # No drain on SIGTERM: `ray start --block` would otherwise wait up to 30 s for its idle node to drain before
    # stopping (stop_head then waits 20 s and kills it); the stop itself is what the test checks.
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}", "RAY_TMPDIR": temp_dir,
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [str(venv_bin / "ray"), "start", "--head", *flags, "--dashboard-host", "127.0.0.1", "--num-cpus", "8",
             "--object-store-memory", str(400 * 1024**2), "--temp-dir", temp_dir, "--block"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    dashboard = f"http://127.0.0.1:{ports[1]}"
    run_dir = tmp_path / "run"
    try:
        wait_for_dashboard(dashboard, head, log)
        submit = subprocess.run(
            ["bash", str(REPO / "deploy" / "ray_job_submit.sh"), f"--output-dir={run_dir}",
             "train.steps=5", "learner.prompts_per_step=4", "rollout.samples_per_prompt=4",
             "data.num_eval_prompts=20"],
            env={**env, "RAY_DASHBOARD_ADDRESS": dashboard, "RAY": str(venv_bin / "ray")},
            capture_output=True, text=True, timeout=900)
    finally:
        left = stop_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    assert "succeeded" in submit.stdout + submit.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 5 and 0 <= summary["accuracy_after"] <= 1
    assert Path(summary["final_model"], "config.json").is_file()
    # the end of the run drew its figures (cli/plots.py)
    figures = sorted(p.name for p in (run_dir / "plots").glob("*.png"))
    assert "overview.png" in figures and len(figures) == 8
    assert all((run_dir / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in figures)
    assert not left, f"processes of the test's Ray cluster still alive: {left}"
