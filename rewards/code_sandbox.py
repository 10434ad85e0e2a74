"""Code verifier: extracts the program from the response's last ```python block and runs it against the
prompt's test cases, each run in a fresh sandbox (rewards/_sandbox_harness.py): no network, its own pid and
mount namespaces, an unprivileged uid, CPU, memory, process and output limits, and a wall-clock limit.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocols.reward import CodeSandboxConfig
from protocols.trajectory import Prompt, VerifierResult
from rewards.registry import register_verifier

HARNESS = str(Path(__file__).with_name("_sandbox_harness.py"))
SETUP_FAILED = 121
_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
_STDERR_KEEP = 2000

_config = CodeSandboxConfig()
_sample_budget_s = 10.0


def configure(cfg: CodeSandboxConfig, sample_timeout_s: float) -> None:
    """Set the limits used by the `code` verifier in this process (the scorer calls it in each pool process).
    Tests stop starting once 90% of `sample_timeout_s` is spent, so the scorer's own timeout never fires."""
    global _config, _sample_budget_s
    _config = cfg
    _sample_budget_s = 0.9 * sample_timeout_s


def extract_code(response: str) -> str | None:
    """The last fenced block tagged python/py (or untagged); None when the response has none."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else None


@dataclass
class RunResult:
    status: str
    """`ok` (exit 0), `runtime_error`, `timeout`, `setup_failed`."""
    stdout: str
    stderr: str
    result: str
    """What a function-call run returned, as JSON text; empty for stdin/stdout runs."""
    seconds: float


def run_in_sandbox(
    code: str,
    cfg: CodeSandboxConfig,
    stdin: str = "",
    fn_name: str = "",
    args: list | None = None,
    timeout_s: float | None = None,
) -> RunResult:
    """Run `code` once in a fresh sandbox. With `fn_name` it is a function-call run; otherwise the program
    reads `stdin` and its stdout is returned."""
    workdir = tempfile.mkdtemp(prefix="relayrl-sbx-")
    timeout_s = cfg.run_timeout_s if timeout_s is None else timeout_s
    try:
        paths = {name: os.path.join(workdir, name) for name in ("job.json", "stdin", "stdout", "stderr", "result")}
        with open(paths["stdin"], "w") as f:
            f.write(stdin)
        files = {name: open(paths[name], "rb" if name == "stdin" else "wb") for name in ("stdin", "stdout", "stderr", "result")}
        try:
            job = {
                "code": code,
                "mode": "call" if fn_name else "stdio",
                "fn_name": fn_name,
                "args": args or [],
                "result_fd": files["result"].fileno(),
                "memory_mb": cfg.memory_mb,
                "cpu_time_s": cfg.cpu_time_s,
                "max_processes": cfg.max_processes,
                "max_output_bytes": cfg.max_output_bytes,
                "tmpfs_mb": cfg.tmpfs_mb,
                "hide_paths": cfg.hide_paths,
                "uid": cfg.sandbox_uid_base + os.getpid() % 50000,
            }
            with open(paths["job.json"], "w") as f:
                json.dump(job, f)
            status, seconds = _launch(paths["job.json"], files, timeout_s)
        finally:
            for f in files.values():
                f.close()
        return RunResult(
            status=status,
            stdout=_read_capped(paths["stdout"], cfg.max_output_bytes),
            stderr=_read_capped(paths["stderr"], _STDERR_KEEP),
            result=_read_capped(paths["result"], cfg.max_output_bytes),
            seconds=seconds,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _launch(job_path: str, files: dict, timeout_s: float) -> tuple[str, float]:
    cmd = [
        # pdeathsig: if this process dies (the scorer kills a hung pool process), the sandbox dies too.
        "setpriv", "--pdeathsig", "KILL", "--",
        "unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
        sys.executable, "-I", "-S", HARNESS, job_path,
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdin=files["stdin"],
        stdout=files["stdout"],
        stderr=files["stderr"],
        pass_fds=(files["result"].fileno(),),
        start_new_session=True,  # its own process group, so one killpg reaches unshare and the harness
    )
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start
    finally:
        # Always (timeouts, and exceptions such as the scorer's soft-timeout signal) make sure it is gone.
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.perf_counter() - start
    if returncode == 0:
        return "ok", seconds
    if returncode == SETUP_FAILED:
        return "setup_failed", seconds
    return "runtime_error", seconds


def _read_capped(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _normalize_lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _values_equal(got: Any, expected: Any) -> bool:
    """JSON values equal, floats within 1e-6 (relative or absolute), tuples compared as lists."""
    if isinstance(expected, float) or isinstance(got, float):
        if isinstance(got, bool) or isinstance(expected, bool):
            return got == expected
        if isinstance(got, int | float) and isinstance(expected, int | float):
            return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6)
        return False
    if isinstance(expected, list | tuple) and isinstance(got, list | tuple):
        return len(got) == len(expected) and all(_values_equal(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(_values_equal(got[k], expected[k]) for k in expected)
    return got == expected


def run_test(code: str, test: dict[str, Any], cfg: CodeSandboxConfig, timeout_s: float) -> tuple[bool, str]:
    """(passed, outcome) for one test case: `{"input", "output"}` (stdin/stdout) or
    `{"fn_name", "args", "output"}` (function call)."""
    if "fn_name" in test:
        run = run_in_sandbox(code, cfg, fn_name=test["fn_name"], args=list(test.get("args", [])), timeout_s=timeout_s)
    else:
        run = run_in_sandbox(code, cfg, stdin=str(test.get("input", "")), timeout_s=timeout_s)
    if run.status == "setup_failed":
        raise RuntimeError(
            f"the code sandbox could not start: {run.stderr.strip()}. It needs root (or CAP_SYS_ADMIN) for "
            "`unshare --net --mount --pid` and util-linux's setpriv; run reward workers where that holds."
        )
    if run.status != "ok":
        return False, run.status
    if "fn_name" in test:
        try:
            got = json.loads(run.result)
        except json.JSONDecodeError:
            return False, "wrong_answer"
        passed = _values_equal(got, test.get("output"))
        return passed, "passed" if passed else "wrong_answer"
    passed = _normalize_lines(run.stdout) == _normalize_lines(str(test.get("output", "")))
    return passed, "passed" if passed else "wrong_answer"


@register_verifier("code")
def verify_code(prompt: Prompt, response: str) -> VerifierResult:
    cfg = _config
    code = extract_code(response)
    total = len(prompt.tests)
    info: dict[str, Any] = {"tests_total": total, "tests_passed": 0, "outcomes": []}
    if code is None:
        info["reason"] = "no_code_block"
        return VerifierResult(reward=0.0, correct=False, info=info)
    if total == 0:
        raise ValueError(f"prompt {prompt.prompt_id} has no test cases; the code verifier needs data.tests_field")
    deadline = time.monotonic() + _sample_budget_s
    for test in prompt.tests:
        remaining = deadline - time.monotonic()
        if remaining < 0.05:
            info["outcomes"].append("budget_exhausted")
            continue
        passed, outcome = run_test(code, test, cfg, min(cfg.run_timeout_s, remaining))
        info["outcomes"].append(outcome)
        info["tests_passed"] += int(passed)
        if not passed and cfg.reward_mode == "all_or_nothing":
            break
    all_passed = info["tests_passed"] == total
    if cfg.reward_mode == "all_or_nothing":
        reward = 1.0 if all_passed else 0.0
    else:
        reward = info["tests_passed"] / total
    return VerifierResult(reward=reward, correct=all_passed, info=info)
