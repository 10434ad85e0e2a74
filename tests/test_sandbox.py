"""Code sandbox: correct programs pass; hostile ones (network, writes outside, fork bomb, 10 GB, sleeping for
ever) get reward 0 within their limits and leave the host as it was."""

import json
import os
import socket
import threading
import time

import pytest
from pydantic import ValidationError

from protocols.reward import CodeSandboxConfig
from protocols.trajectory import Prompt
from rewards import code_sandbox
from rewards.code_sandbox import extract_code, run_in_sandbox, verify_code

# Wall limit generous for a loaded machine (sandbox start included); CPU limit short. A uid range of this file's
# own, apart from the default one other tests' sandboxes use (they may run at the same time, in another pytest
# worker): the process counts below see this file's sandboxes alone.
FAST = CodeSandboxConfig(run_timeout_s=5.0, cpu_time_s=2, sandbox_uid_base=100_000_000)
UID_RANGE = range(FAST.sandbox_uid_base, FAST.sandbox_uid_base + (1 << 22))  # base + a launcher pid (< 2^22)
ECHO_TESTS = [{"input": "21\n", "output": "42\n"}, {"input": "5\n", "output": "10"}]


def _respond(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\n"


def _score(code: str, tests=ECHO_TESTS, cfg: CodeSandboxConfig = FAST, budget_s: float = 30.0):
    code_sandbox.configure(cfg, sample_timeout_s=budget_s)
    prompt = Prompt(prompt_id="code/test/0", prompt_token_ids=[0], tests=tests)
    return verify_code(prompt, _respond(code))


def _sandbox_processes_on_host() -> int:
    """Processes on the host whose real uid is one of this file's sandbox uids (nothing else uses those)."""
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError, StopIteration, ValueError):
            continue
        count += uid in UID_RANGE
    return count


def test_extract_code_takes_last_python_block():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("no code here") is None


def test_extract_code_ignores_untagged_and_other_language_blocks():
    # The program is the python block; the untagged block after it is sample output, the bash block a command.
    response = "```python\nprint(1)\n```\nOutput:\n```\n1\n```\nRun:\n```bash\npython a.py\n```"
    assert extract_code(response) == "print(1)\n"
    # Only untagged blocks: no program at all (reward 0, reason no_code_block).
    assert extract_code("```\nprint(1)\n```") is None
    prompt = Prompt(prompt_id="code/test/0", prompt_token_ids=[0], tests=ECHO_TESTS)
    assert verify_code(prompt, "```\nprint(int(input()) * 2)\n```").info["reason"] == "no_code_block"
    # The tag is the info string's first word, compared in any case.
    assert extract_code("```Python title=a.py\nx = 2\n```") == "x = 2\n"


def test_language_tags_are_configurable():
    response = "```python\nprint(1)\n```\n```cpp\nint main() {}\n```"
    assert extract_code(response, ["cpp", "c++"]) == "int main() {}\n"
    assert extract_code(response, ["rust"]) is None
    # Through the config the code verifier uses: with only `py` allowed, a ```python block is not a program.
    code_sandbox.configure(FAST.model_copy(update={"language_tags": ["py"]}), sample_timeout_s=30.0)
    try:
        prompt = Prompt(prompt_id="code/test/0", prompt_token_ids=[0], tests=ECHO_TESTS)
        assert verify_code(prompt, _respond("print(int(input()) * 2)")).info["reason"] == "no_code_block"
        assert verify_code(prompt, "```py\nprint(int(input()) * 2)\n```").reward == 1.0
    finally:
        code_sandbox.configure(FAST, sample_timeout_s=30.0)


def test_stdio_program_passes_all_tests():
    # 21 -> 42 and 5 -> 10: both pass, reward 2/2
    result = _score("print(int(input()) * 2)")
    assert (result.reward, result.correct, result.info["tests_passed"]) == (1.0, True, 2)


def test_fraction_and_all_or_nothing_modes():
    # doubles only 21 correctly (prints 42 for every input): 1 of 2 tests -> 0.5, all-or-nothing -> 0
    assert _score("input(); print(42)").reward == 0.5
    strict = FAST.model_copy(update={"reward_mode": "all_or_nothing"})
    assert _score("input(); print(42)", cfg=strict).reward == 0.0


def test_function_call_tests_and_solution_class():
    tests = [{"fn_name": "add", "args": [1, 2], "output": 3}, {"fn_name": "add", "args": [0.1, 0.2], "output": 0.3}]
    assert _score("def add(a, b):\n    return a + b", tests).reward == 1.0
    leetcode = "class Solution:\n    def add(self, a, b):\n        return a + b"
    assert _score(leetcode, tests).reward == 1.0
    assert _score("def add(a, b):\n    return a - b", tests).reward == 0.0


def test_no_code_block_scores_zero():
    prompt = Prompt(prompt_id="code/test/0", prompt_token_ids=[0], tests=ECHO_TESTS)
    assert verify_code(prompt, "I would use a loop").info["reason"] == "no_code_block"


def test_socket_cannot_reach_the_host():
    # A server on the host's loopback: the sandbox has its own network namespace, so the connection fails.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(_accept(server)))
    thread.start()
    code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint(int(input()) * 2)"
    result = _score(code)
    thread.join()
    server.close()
    assert result.reward == 0.0
    assert result.info["outcomes"] == ["runtime_error", "runtime_error"]
    assert accepted == [None]


def _accept(server: socket.socket):
    try:
        return server.accept()
    except TimeoutError:
        return None


def test_writes_outside_the_sandbox_do_not_reach_the_host(tmp_path):
    # tmp_path is world-writable here, yet the program sees a fresh empty /tmp and an empty /work.
    tmp_path.chmod(0o777)
    outside = [tmp_path / "escaped", "/work/escaped_by_sandbox", "/var/tmp/escaped_by_sandbox"]
    code = "".join(f"open({str(p)!r}, 'w').write('x')\n" for p in outside) + "print(int(input()) * 2)"
    assert _score(code).reward == 0.0
    for path in outside:
        assert not os.path.exists(path)
    # Its own working folder is writable.
    assert _score("open('scratch.txt', 'w').write('ok')\nprint(int(input()) * 2)").reward == 1.0


def test_fork_bomb_is_contained_and_cleaned_up():
    assert _sandbox_processes_on_host() == 0
    start = time.monotonic()
    result = _score("import os\nwhile True:\n    os.fork()")
    assert result.reward == 0.0
    assert time.monotonic() - start < 2 * FAST.run_timeout_s + 2
    # Every forked process died with the sandbox's pid namespace: none is left running as a sandbox uid.
    time.sleep(0.2)
    assert _sandbox_processes_on_host() == 0


def test_ten_gigabytes_fail_under_the_memory_limit():
    result = _score("x = bytearray(10 * 2**30)\nprint(int(input()) * 2)")
    assert result.reward == 0.0 and result.info["outcomes"][0] == "runtime_error"


def test_sleeping_forever_is_killed_at_the_wall_limit():
    cfg = FAST.model_copy(update={"run_timeout_s": 0.5})
    start = time.monotonic()
    result = _score("import time\ntime.sleep(1000)", cfg=cfg)
    # two tests, each killed at 0.5 s: about 1 s in all
    assert time.monotonic() - start < 4
    assert result.info["outcomes"] == ["timeout", "timeout"]
    assert _score("print(int(input()) * 2)").reward == 1.0  # and the next sample runs normally


def test_sample_budget_stops_starting_tests():
    # budget 0.9 * 1.0 s = 0.9 s: the first test is killed at 0.8 s, the second gets the last 0.1 s at most
    cfg = FAST.model_copy(update={"run_timeout_s": 0.8})
    result = _score("import time\ntime.sleep(1000)", cfg=cfg, budget_s=1.0)
    assert result.info["outcomes"][0] == "timeout"
    assert result.info["outcomes"][1] in ("timeout", "budget_exhausted")


def test_output_is_capped():
    cfg = FAST.model_copy(update={"max_output_bytes": 4096})
    run = run_in_sandbox("while True:\n    print('x' * 1000)", cfg)
    assert run.status == "runtime_error"
    assert len(run.stdout) <= 4096


def test_program_runs_unprivileged_without_the_host_files():
    code = (
        "import json, os, sys\n"
        "print(json.dumps([os.getuid(), os.path.exists('/work'), os.path.exists('/home'), os.listdir('/run'),\n"
        "    os.listdir('/tmp'), os.listdir('/dev/shm'), sorted(p for p in os.listdir('/proc') if p.isdigit()),\n"
        "    os.path.exists(sys.executable)]))"
    )
    uid, work, home, run, tmp, shm, pids, python = json.loads(run_in_sandbox(code, FAST).stdout)
    assert uid in UID_RANGE
    # No data or home folders; /run, /tmp and /dev/shm private and empty; only its own processes: the harness's
    # supervisor (pid 1) and the program (pid 2); the interpreter is visible so programs may start Python again.
    assert (work, home, run, tmp, shm, pids, python) == (False, False, [], [], [], ["1", "2"], True)


def test_readonly_paths_must_be_absolute_folders_below_root():
    for bad in (["/"], ["usr"], ["/usr/../root"]):
        with pytest.raises(ValidationError, match="readonly_paths"):
            CodeSandboxConfig(readonly_paths=bad)
    assert CodeSandboxConfig(readonly_paths=["/usr", "/opt/tools"]).readonly_paths == ["/usr", "/opt/tools"]
