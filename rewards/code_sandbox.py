"""Code verifier: extracts the program from the response's last block tagged with a configured language
(```python) and runs it against the prompt's test cases, each run in a fresh sandbox
(rewards/_sandbox_harness.py): an allow-listed environment, its own network, pid, mount, IPC and UTS namespaces,
a read-only allow-list view of the filesystem, a uid no other live sandbox has, CPU, memory (a cgroup for the
whole process tree where one is writable), process and output limits, and a wall-clock limit.
"""

import fcntl
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

from protocols.reward import CodeSandboxConfig, RewardConfig
from protocols.trajectory import Prompt, VerifierResult
from rewards import sandbox_cgroup
from rewards.spec import VerifierSpec

HARNESS = str(Path(__file__).with_name("_sandbox_harness.py"))
SETUP_FAILED = 121
READY = b"R"
# The interpreter itself, not a virtual environment's link to it: the sandbox shows only the Python prefix.
PYTHON = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
# The whole environment of the sandbox, given at process start (never the reward worker's own: it may hold
# API tokens, and an environment block stays readable in /proc/self/environ even after os.environ.clear()).
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
# A fenced block: its info string (language tag, maybe more words) and its body.
_FENCED_BLOCK = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_STDERR_KEEP = 2000

_config = CodeSandboxConfig()
_sample_budget_s = 10.0


def configure(cfg: CodeSandboxConfig, sample_timeout_s: float) -> None:
    """Set the limits used by the `code` verifier in this process (the scorer calls it in each pool process).
    Tests stop starting once 90% of `sample_timeout_s` is spent, so the scorer's own timeout never fires."""
    global _config, _sample_budget_s
    _config = cfg
    _sample_budget_s = 0.9 * sample_timeout_s


def _configure_from(reward: RewardConfig) -> None:
    configure(reward.code, reward.timeout_s)


def extract_code(response: str, language_tags: list[str] | None = None) -> str | None:
    """The body of the last fenced block whose language tag (the info string's first word, any case) is one of
    `language_tags` (default: this process's `reward.code.language_tags`); None when there is none. Untagged
    blocks and blocks in other languages (sample output, shell commands) are never the program."""
    tags = {t.lower() for t in (_config.language_tags if language_tags is None else language_tags)}
    programs = [body for info, body in _FENCED_BLOCK.findall(response) if (info.split() or [""])[0].lower() in tags]
    return programs[-1] if programs else None


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
    reads `stdin` and its stdout is returned. Status `setup_failed` means the program never ran (the
    sandbox could not be built: no unshare permission, a missing tool, a refused mount)."""
    workdir = tempfile.mkdtemp(prefix="relayrl-sbx-")
    timeout_s = cfg.run_timeout_s if timeout_s is None else timeout_s
    try:
        paths = {name: os.path.join(workdir, name) for name in ("stdin", "stdout", "stderr", "result")}
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
                "readonly_paths": cfg.readonly_paths,
            }
            status, seconds, setup_error = _launch(job, files, cfg, timeout_s)
        finally:
            for f in files.values():
                f.close()
        stderr = _read_capped(paths["stderr"], _STDERR_KEEP)
        return RunResult(
            status=status,
            stdout=_read_capped(paths["stdout"], cfg.max_output_bytes),
            stderr=f"{setup_error}: {stderr.strip()}" if setup_error else stderr,
            result=_read_capped(paths["result"], cfg.max_output_bytes),
            seconds=seconds,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _open_cgroup(cfg: CodeSandboxConfig) -> sandbox_cgroup.RunCgroup | None:
    if cfg.memory_cgroup == "off" or (cfg.memory_cgroup == "auto" and sandbox_cgroup.scope() == "per-process"):
        return None
    return sandbox_cgroup.RunCgroup(cfg.memory_mb << 20, cfg.max_processes)


def _launch(job: dict, files: dict, cfg: CodeSandboxConfig, timeout_s: float) -> tuple[str, float, str]:
    """(status, seconds, setup error text). The harness reads the job from a pipe and reports on a second
    one that the sandbox is built; an exit without that report is `setup_failed`, whatever its status."""
    start = time.perf_counter()
    try:
        cgroup = _open_cgroup(cfg)
    except OSError as err:
        return "setup_failed", time.perf_counter() - start, f"memory cgroup: {err}"
    job_r, job_w = os.pipe()
    status_r, status_w = os.pipe()
    cmd = [
        # pdeathsig: if this process dies (the scorer kills a hung pool process), the sandbox dies too.
        "setpriv", "--pdeathsig", "KILL", "--",
        "unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--",
        PYTHON, "-I", "-S", HARNESS, str(job_r), str(status_w),
    ]  # fmt: skip
    proc = None
    try:
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=files["stdin"],
                stdout=files["stdout"],
                stderr=files["stderr"],
                pass_fds=(files["result"].fileno(), job_r, status_w),
                env=SANDBOX_ENV,
                start_new_session=True,  # its own process group, so one killpg reaches unshare and the harness
            )
        except OSError as err:
            return "setup_failed", time.perf_counter() - start, f"could not start {cmd[0]}: {err}"
        finally:
            os.close(job_r)
            os.close(status_w)
        # The launcher's pid is unique among live processes, and it lives exactly as long as the sandbox:
        # so no two sandboxes running at once share a uid (nor the per-uid process limit).
        job["uid"] = cfg.sandbox_uid_base + proc.pid
        job["cgroup_procs"] = cgroup.procs_file if cgroup else ""
        try:
            with os.fdopen(job_w, "wb", closefd=True) as pipe:
                job_w = -1  # closed with the file object
                pipe.write(json.dumps(job).encode())
        except BrokenPipeError:
            pass  # the harness is gone already; reported below as setup_failed
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start, ""
        seconds = time.perf_counter() - start
        if not _was_ready(status_r):
            return "setup_failed", seconds, f"the sandbox was not built (exit status {returncode})"
        return ("ok" if returncode == 0 else "runtime_error"), seconds, ""
    finally:
        # Always (timeouts, and exceptions such as the scorer's soft-timeout signal anywhere above) make sure it
        # is gone: killing the launcher kills the harness's process 1, and with it the whole pid namespace.
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if job_w >= 0:
            os.close(job_w)
        os.close(status_r)
        if cgroup is not None:
            cgroup.remove()


def _was_ready(status_r: int) -> bool:
    fcntl.fcntl(status_r, fcntl.F_SETFL, os.O_NONBLOCK)
    try:
        return os.read(status_r, 1) == READY
    except BlockingIOError:
        return False


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
        # Fail closed: the sample scores 0 through the scorer's error path (counted, logged); the program
        # never runs outside the sandbox.
        raise RuntimeError(
            f"the code sandbox could not start: {run.stderr.strip()}. It needs root (or CAP_SYS_ADMIN) for "
            "`unshare --net --mount --pid --ipc --uts`, mounts and pivot_root, and util-linux's setpriv; run "
            "reward workers where that holds."
        )
    if run.status != "ok":
        return False, run.status
    if "fn_name" in test:
        try:
            got = json.loads(run.result)
        except (ValueError, RecursionError):
            # The program's return value (at most reward.code.max_output_bytes of JSON) is not JSON, holds an int
            # past Python's int-from-text limit, or nests past the decoder's recursion limit: never a right answer.
            return False, "wrong_answer"
        passed = _values_equal(got, test.get("output"))
        return passed, "passed" if passed else "wrong_answer"
    passed = _normalize_lines(run.stdout) == _normalize_lines(str(test.get("output", "")))
    return passed, "passed" if passed else "wrong_answer"


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


SPEC = VerifierSpec(name="code", fn=verify_code, configure=_configure_from)
