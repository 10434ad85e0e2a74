"""The ToolBox: the calculator (exact values, refusals), the python tool in the code verifier's sandbox (a normal
program, an error, a timeout, hostile programs contained as in tests/test_sandbox*.py), user tools from
`module:function`, and an unknown name. `run` never raises: each failure is an error kind and its text."""

import os
import secrets
import socket
import threading
import time

import pytest

from protocols.reward import CodeSandboxConfig, RewardConfig
from protocols.tools import ToolsConfig
from rewards.tools import MAX_EXPRESSION_DEPTH, MAX_RESULT_DIGITS, ToolBox, calculate

# As the sandbox tests: wall limit generous for a loaded machine, CPU limit short.
# A uid base of this module's own (the default's is 200000, tests/test_sandbox.py's 100_000_000): the count of
# sandbox processes left on the host sees only this module's, whatever runs beside it (TEST_WORKERS=2).
REWARD = RewardConfig(code=CodeSandboxConfig(run_timeout_s=5.0, cpu_time_s=2, sandbox_uid_base=300_000_000))
UID_RANGE = range(REWARD.code.sandbox_uid_base, REWARD.code.sandbox_uid_base + (1 << 22))  # base + a launcher pid
TOOLS = ToolsConfig(builtin=["python", "calculator"], timeout_s=8.0)


@pytest.fixture(scope="module")
def box() -> ToolBox:
    return ToolBox(TOOLS, REWARD)


# ----- calculator -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("expression", "value"), [
    ("123*4567", "561741"),            # 123 * 4567 = 561741
    ("1234 * 5678", "7006652"),        # 1234 * 5678 = 7006652
    ("(2 + 3) * -4", "-20"),
    ("7 / 2", "3.5"),
    ("6 / 3", "2"),                    # a whole float prints without .0
    ("7 // 2", "3"),
    ("-7 % 3", "2"),                   # Python's sign rule: -7 = 3 * -3 + 2
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("0.1 * 3", "0.30000000000000004"),  # floats are floats
    ("99999999999 * 99999999999", "9999999999800000000001"),  # integers stay exact
])  # fmt: skip
def test_calculator_values(expression, value):
    assert calculate(expression) == value


def test_calculator_through_the_toolbox(box):
    result = box.run("calculator", "123*4567")
    assert (result.output, result.error) == ("561741", "")
    assert result.seconds >= 0


def test_division_by_zero_is_an_exception(box):
    result = box.run("calculator", "1/0")
    assert (result.output, result.error) == ("ZeroDivisionError: division by zero", "exception")


@pytest.mark.parametrize("expression", ["9**9**9", "10**1000", "10**1001", "(10**600) * (10**600)", "2.0 ** 5000",
                                        "2 ** (10**999)", "(-10) ** 1001"])
def test_huge_numbers_are_refused_not_computed(box, expression):
    # 9**(9**9) has 9**9 * log10(9) = 3.7e8 digits; 10**1000 has 1001; 10**1001 has 1002; 10**1200 has 1201;
    # 2**(10**999) about 3e998: all over 1000
    start = time.monotonic()
    result = box.run("calculator", expression)
    assert result.error == "exception"
    assert f"more than {MAX_RESULT_DIGITS} digits" in result.output
    assert time.monotonic() - start < 5.0  # refused at once (a computed 9**9**9 takes minutes)


def test_the_largest_number_allowed_has_1000_digits():
    # 10**999 is 1 and 999 zeros: 1000 digits, the most MAX_RESULT_DIGITS allows
    assert calculate("10**999") == "1" + "0" * 999
    assert len(calculate("2**3321")) == 1000  # 3321 * log10(2) = 999.7: 5.3e999, 1000 digits
    with pytest.raises(ValueError, match="more than 1000 digits"):
        calculate("2**3322")  # 3322 * log10(2) = 1000.02: 1001 digits


def test_a_power_tower_is_refused_at_once():
    # 9**9**9 is 9**387420489: refused from its size, never computed
    start = time.perf_counter()
    with pytest.raises(ValueError, match="9 \\*\\* 387420489 has more than 1000 digits"):
        calculate("9**9**9")
    assert time.perf_counter() - start < 1.0


def test_a_deeply_nested_expression_is_refused_before_evaluation():
    # 999 unary minus signs and a 1: 1000 characters, a syntax tree 1000 levels deep (999 - and the number)
    with pytest.raises(ValueError, match=f"nested 1000 levels deep; the calculator takes at most {MAX_EXPRESSION_DEPTH}"):
        calculate("-" * 999 + "1")
    # 200 levels is the limit: 199 minus signs and the number
    assert calculate("-" * 199 + "1") == "-1"


def test_201_nested_parentheses_are_a_syntax_error_not_a_crash():
    # Python's parser refuses more than 200 nested parentheses itself
    with pytest.raises(ValueError, match="too many nested parentheses"):
        calculate("(" * 201 + "1" + ")" * 201)


def test_a_value_past_the_float_range_is_refused():
    # 10**400 / 3 is a float division: 3.3e399 is past the float range (1.8e308), so OverflowError becomes a refusal
    with pytest.raises(ValueError, match="too large for a float"):
        calculate("10**400 / 3")
    with pytest.raises(ValueError, match="too large for a float"):
        calculate("10.0 ** 400")


@pytest.mark.parametrize(("expression", "message"), [
    ("__import__('os').system('id')", "unsupported expression"),
    ("x + 1", "unsupported expression"),
    ("2 ^ 3", "write `**`"),
    ("1 +", "not an arithmetic expression"),
    ("'a' * 3", "unsupported expression"),
    ("True + 1", "unsupported expression"),
    ("1" * 1001, "at most 1000"),
    ("(-8) ** 0.5", "complex"),
])  # fmt: skip
def test_anything_but_arithmetic_is_refused(box, expression, message):
    result = box.run("calculator", expression)
    assert result.error == "exception"
    assert message in result.output


# ----- python, in the code verifier's sandbox -------------------------------------------------------------------
def test_python_returns_stdout(box):
    result = box.run("python", "print(sum(range(10)))\nprint('x:y')")
    # 0 + 1 + ... + 9 = 45
    assert (result.output, result.error) == ("45\nx:y\n", "")


def test_python_program_in_a_fence_runs_its_body(box):
    assert box.run("python", "```python\nprint(2 ** 5)\n```").output == "32\n"


def test_python_error_keeps_stdout_and_the_traceback_end(box):
    result = box.run("python", "print('before')\n1 / 0")
    assert result.error == "exception"
    assert result.output.startswith("before\n")
    assert result.output.endswith("ZeroDivisionError: division by zero")


def test_python_exit_status_without_stderr_is_named(box):
    result = box.run("python", "import sys\nprint(1)\nsys.exit(3)")
    assert result.error == "exception"
    assert result.output.startswith("1\nRuntimeError: the program ended with an error status")


def test_python_timeout(tmp_path):
    box = ToolBox(TOOLS.model_copy(update={"timeout_s": 1.5}), REWARD)
    start = time.monotonic()
    result = box.run("python", "import time\nprint('started', flush=True)\ntime.sleep(1000)")
    assert result.error == "timeout"
    stopped = "TimeoutError: the program ran past tools.timeout_s=1.5 s and was stopped"
    # what it printed before the limit comes first (on a loaded machine the sandbox may not have started yet)
    assert result.output in ("started\n" + stopped, stopped)
    assert time.monotonic() - start < 5
    # and the next call runs normally (with the usual limit: a sandbox may take a second to start on a loaded host)
    assert ToolBox(TOOLS, REWARD).run("python", "print(1)").output == "1\n"


def test_python_cannot_see_the_callers_environment(box, monkeypatch):
    secret = "tok-" + secrets.token_hex(16)
    monkeypatch.setenv("RELAYRL_TEST_SECRET", secret)
    code = """
import os, re
found = set(v for k, v in os.environ.items() if k == 'RELAYRL_TEST_SECRET')
for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:
    try:
        found.update(x.decode() for x in re.findall(rb'RELAYRL_TEST_SECRET=([^\\x00]*)', open(f'/proc/{pid}/environ', 'rb').read()))
    except OSError:
        pass
print(sorted(found) or 'nothing')
"""
    result = box.run("python", code)
    assert (result.output, result.error) == ("nothing\n", "")


def test_python_writes_never_reach_the_host(box, tmp_path):
    # tmp_path is world-writable, yet the program sees a fresh /tmp and no /work
    tmp_path.chmod(0o777)
    outside = [str(tmp_path / "escaped"), "/work/escaped_by_tool", "/var/tmp/escaped_by_tool"]
    code = "ok = []\nfor p in %r:\n    try:\n        open(p, 'w').write('x'); ok.append(p)\n" \
           "    except OSError:\n        pass\nprint(ok)" % outside
    assert box.run("python", code).output == "[]\n"
    assert not any(os.path.exists(p) for p in outside)


def test_python_cannot_reach_the_hosts_network(box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except TimeoutError:
            accepted.append(None)

    thread = threading.Thread(target=accept)
    thread.start()
    port = server.getsockname()[1]
    result = box.run("python", f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    thread.join()
    server.close()
    assert result.error == "exception"
    assert accepted == [None]


def test_python_runs_unprivileged_and_alone(box):
    code = "import os\nprint(os.getuid() >= %d, sorted(p for p in os.listdir('/proc') if p.isdigit()))" \
        % REWARD.code.sandbox_uid_base
    # its own pid namespace: the harness (1) and the program (2) only
    assert box.run("python", code).output == "True ['1', '2']\n"


def test_python_cannot_become_root_in_a_user_namespace(box):
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000), ctypes.get_errno())"
    # -1 with EPERM (1)
    assert box.run("python", code).output == "-1 1\n"


def test_python_ten_gigabytes_fail_under_the_memory_limit(box):
    result = box.run("python", "x = bytearray(10 * 2**30)\nprint('allocated')")
    assert result.error == "exception"
    assert result.output.endswith("MemoryError")


def test_python_calls_at_once_from_pool_threads_run_as_different_uids(box):
    # the agent loop runs calls in a thread pool: each call is its own sandbox with a uid of its own
    results = []
    code = "import os, time\nprint(os.getuid())\ntime.sleep(0.5)"
    threads = [threading.Thread(target=lambda: results.append(box.run("python", code))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.error for r in results] == ["", "", ""]
    uids = {int(r.output) for r in results}
    assert len(uids) == 3 and min(uids) >= REWARD.code.sandbox_uid_base


def test_python_fork_bomb_is_contained(box):
    start = time.monotonic()
    result = box.run("python", "import os\nwhile True:\n    os.fork()")
    assert result.error in ("exception", "timeout")
    assert time.monotonic() - start < TOOLS.timeout_s + 4
    time.sleep(0.2)
    assert _sandbox_processes_on_host() == 0


def test_python_leaves_no_process_behind_whatever_it_does_to_itself():
    # It clears its parent-death signal, leaves its session and forks, then both sleep: the tool's wall limit ends
    # them all (the sandbox's pid namespace dies with it).
    box = ToolBox(TOOLS.model_copy(update={"timeout_s": 1.0}), REWARD)
    name = "rl" + secrets.token_hex(6)
    code = f"""
import ctypes, os, time
libc = ctypes.CDLL(None)
def hide():
    libc.prctl(1, 0, 0, 0, 0)
    libc.prctl(15, b"{name}", 0, 0, 0)
    try:
        os.setsid()
    except OSError:
        pass
hide()
if os.fork() == 0:
    hide()
time.sleep(60)
"""
    try:
        assert box.run("python", code).error == "timeout"
        time.sleep(0.3)
        assert _processes_named(name) == []
    finally:
        for pid in _processes_named(name):  # only if the test failed: leave the machine clean
            os.kill(pid, 9)


def _processes_named(name: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _sandbox_processes_on_host() -> int:
    count = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError, StopIteration, ValueError):
            continue
        count += uid in UID_RANGE
    return count


def test_python_sandbox_that_cannot_start_fails_closed(monkeypatch, tmp_path):
    # No permission to build the sandbox (as tests/test_sandbox_escapes.py simulates): the program never runs.
    from rewards import code_sandbox

    marker = tmp_path / "ran"
    monkeypatch.setattr(code_sandbox, "PYTHON", "/nonexistent/python")
    result = ToolBox(TOOLS, REWARD).run("python", f"open({str(marker)!r}, 'w').write('x')")
    assert result.error == "exception"
    assert "could not start" in result.output
    assert not marker.exists()


# ----- user tools and unknown names -----------------------------------------------------------------------------
def shout(arguments: str) -> str:
    return arguments.upper() + "!"


def fail(arguments: str) -> str:
    raise KeyError(arguments)


def hang(arguments: str) -> str:
    time.sleep(float(arguments))
    return "late"


def count(arguments: str) -> int:
    return len(arguments)


CUSTOM = {"shout": "tests.test_tools:shout", "fail": "tests.test_tools:fail", "hang": "tests.test_tools:hang",
          "count": "tests.test_tools:count"}


def test_user_tool_from_module_function():
    box = ToolBox(ToolsConfig(custom=CUSTOM, timeout_s=0.5), REWARD)
    assert box.names == ["shout", "fail", "hang", "count"]
    result = box.run("shout", "hello: world")
    assert (result.output, result.error) == ("HELLO: WORLD!", "")
    # a value that is not text is returned as its str()
    assert box.run("count", "abcd").output == "4"


def test_user_tool_that_raises_or_hangs_is_an_error_not_a_crash():
    box = ToolBox(ToolsConfig(custom=CUSTOM, timeout_s=0.5), REWARD)
    raised = box.run("fail", "k")
    assert (raised.output, raised.error) == ("KeyError: 'k'", "exception")
    start = time.monotonic()
    hung = box.run("hang", "3")
    assert hung.error == "timeout"
    assert hung.output == "TimeoutError: the tool ran past tools.timeout_s=0.5 s"
    assert time.monotonic() - start < 2


def test_user_tool_that_cannot_be_imported_fails_at_construction():
    with pytest.raises(ValueError, match=r"tools.custom.lookup='no_such_module_xyz:run' could not be loaded"):
        ToolBox(ToolsConfig(custom={"lookup": "no_such_module_xyz:run"}), REWARD)
    with pytest.raises(ValueError, match=r"tools.custom.lookup='tests.test_tools:nothing' could not be loaded"):
        ToolBox(ToolsConfig(custom={"lookup": "tests.test_tools:nothing"}), REWARD)
    with pytest.raises(ValueError, match="is a dict, not a function"):
        ToolBox(ToolsConfig(custom={"lookup": "tests.test_tools:CUSTOM"}), REWARD)


def test_unknown_tool_lists_the_known_ones(box):
    result = box.run("weather", "Paris")
    assert result.error == "unknown_tool"
    assert result.output == "unknown tool 'weather'; the tools are: python, calculator"
