"""deploy/ray_job_submit.sh against a stand-in `ray` command: what it submits, and its retry while a just-started
head has no job agent (the real submission runs in tests/test_job_submit.py)."""

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO

NO_AGENT = "RuntimeError: Request failed with status code 500: No available agent to submit job, please try again later.."

STAND_IN = """#!/usr/bin/env bash
# The Nth call answers with line N of $ANSWERS: "<exit code> <text>"; every call's arguments go to $CALLS.
echo "$*" >> "$CALLS"
n=$(wc -l < "$CALLS")
line=$(sed -n "${n}p" "$ANSWERS")
echo "${line#* }" >&2
exit "${line%% *}"
"""


def submit(tmp_path: Path, answers: list[str], wait_s: int = 60) -> tuple[subprocess.CompletedProcess, list[str]]:
    ray = tmp_path / "ray"
    ray.write_text(STAND_IN)
    ray.chmod(0o755)
    (tmp_path / "answers").write_text("\n".join(answers) + "\n")
    env = {**os.environ, "RAY": str(ray), "CALLS": str(tmp_path / "calls"), "ANSWERS": str(tmp_path / "answers"),
           "RAY_DASHBOARD_ADDRESS": "http://127.0.0.1:1", "RELAYRL_SUBMIT_WAIT_S": str(wait_s)}
    done = subprocess.run(["bash", str(REPO / "deploy" / "ray_job_submit.sh"), "train.steps=5"], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, (tmp_path / "calls").read_text().splitlines()


def test_a_head_without_its_job_agent_yet_is_asked_again_and_the_job_runs(tmp_path):
    done, calls = submit(tmp_path, [f"1 {NO_AGENT}", "0 Job 'raysubmit_1' succeeded"])
    assert done.returncode == 0 and "succeeded" in done.stdout
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0].startswith("job submit --address http://127.0.0.1:1 --working-dir . --runtime-env-json ")
    assert calls[0].endswith("-- relayrl train train.steps=5")
    assert "job agent is not up yet" in done.stderr


def test_any_other_failure_is_not_submitted_again(tmp_path):
    done, calls = submit(tmp_path, ["3 Job 'raysubmit_1' failed", "0 Job 'raysubmit_2' succeeded"])
    assert done.returncode == 3 and len(calls) == 1


def test_past_the_wait_it_stops_naming_the_setting(tmp_path):
    done, calls = submit(tmp_path, [f"1 {NO_AGENT}"] * 3, wait_s=0)
    assert done.returncode == 1 and len(calls) == 1
    assert "RELAYRL_SUBMIT_WAIT_S=0" in done.stderr
