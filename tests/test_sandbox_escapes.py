"""Hostile programs sent through the code verifier's public API, one per kind of escape found before
(environment, files outside the sandbox, host Unix sockets, SysV IPC, uid sharing, memory over the whole
process tree, running with no permission to build the sandbox). Each asserts the escape fails inside AND that
the host is unchanged afterwards."""

import json
import os
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from protocols.reward import CodeSandboxConfig
from protocols.trajectory import Prompt
from rewards import code_sandbox, sandbox_cgroup
from rewards.code_sandbox import run_in_sandbox, verify_code

FAST = CodeSandboxConfig(run_timeout_s=8.0, cpu_time_s=4)  # wall limit generous for a loaded machine
REPO = Path(__file__).resolve().parents[1]


def _verify(code: str, expected_output: str, cfg: CodeSandboxConfig = FAST):
    """verify_code on one stdin/stdout test whose expected output is what a successful escape prints."""
    code_sandbox.configure(cfg, sample_timeout_s=30.0)
    prompt = Prompt(prompt_id="code/escape/0", prompt_token_ids=[0], tests=[{"input": "", "output": expected_output}])
    return verify_code(prompt, f"```python\n{code}\n```")


def test_caller_environment_is_not_visible(monkeypatch):
    # A token in the reward worker's environment: the program looks in os.environ, in every /proc/*/environ it
    # can see and in its own stack memory (where the initial environment block of a process lives).
    secret = "tok-" + secrets.token_hex(16)
    monkeypatch.setenv("RELAYRL_TEST_SECRET", secret)
    code = """
import ctypes, os, re
found = set()
if 'RELAYRL_TEST_SECRET' in os.environ:
    found.add(os.environ['RELAYRL_TEST_SECRET'])
for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:
    try:
        found.update(re.findall(rb'RELAYRL_TEST_SECRET=([^\\x00]*)', open(f'/proc/{pid}/environ', 'rb').read()))
    except OSError:
        pass
with open('/proc/self/maps') as maps:
    for line in maps:
        if '[stack]' in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
            found.update(re.findall(rb'RELAYRL_TEST_SECRET=([^\\x00]*)', ctypes.string_at(lo, hi - lo)))
print(' '.join(sorted(v.decode() if isinstance(v, bytes) else v for v in found)) or 'nothing')
"""
    assert _verify(code, secret).reward == 0.0
    run = run_in_sandbox(code, FAST)
    assert run.status == "ok", run.stderr
    assert run.stdout.strip() == "nothing"
    assert secret not in run.stdout + run.stderr
    # Only the allow-listed environment is there at all.
    env = json.loads(run_in_sandbox("import os, json; print(json.dumps(dict(os.environ)))", FAST).stdout)
    assert env == code_sandbox.SANDBOX_ENV
    assert os.environ["RELAYRL_TEST_SECRET"] == secret  # the caller's own environment is untouched


def _host_entries_named(token: str) -> list[str]:
    """Paths on the host whose name holds `token`, in the world-writable places and the allowed read-only ones."""
    roots = ["/run", "/var/run", "/run/lock", "/var/lock", "/tmp", "/var/tmp", "/dev/shm", "/usr", "/etc", "/"]
    roots.append(os.path.realpath(sys.base_prefix))
    hits = []
    for root in roots:
        try:
            hits += [os.path.join(root, n) for n in os.listdir(root) if token in n]
        except OSError:
            continue
    return hits


def test_files_written_outside_the_sandbox_folder_never_reach_the_host():
    token = "relayrl-escape-" + secrets.token_hex(6)
    targets = ["/run/lock", "/var/lock", "/run", "/var/run", "/dev/shm", "/var/tmp", "/tmp", "/usr", "/etc", "/",
               os.path.realpath(sys.base_prefix)]  # fmt: skip
    code = f"""
import os
written = []
for folder in {targets!r}:
    for i in range(50):  # many files, as a program filling the host's disk would
        try:
            with open(os.path.join(folder, '{token}-%d' % i), 'w') as f:
                f.write('x')
            written.append(folder)
        except OSError:
            break
print(sorted(set(written)))
"""
    assert _host_entries_named(token) == []
    assert _verify(code, "[]").reward == 0.0  # it can write somewhere: its own /tmp and /dev/shm
    run = run_in_sandbox(code, FAST)
    assert run.status == "ok", run.stderr
    # Inside, only the private /tmp (its working folder) and /dev/shm took the files...
    assert run.stdout.strip() == "['/dev/shm', '/tmp']"
    # ...and nothing of them is on the host afterwards, in any of the places tried.
    assert _host_entries_named(token) == []


def test_host_unix_sockets_are_unreachable(tmp_path):
    # Servers on the host: filesystem sockets in /run, /run/lock, /tmp, /dev/shm and a pytest folder, and one
    # in the abstract namespace. The program tries each; none may accept a connection.
    token = secrets.token_hex(6)
    tmp_path.chmod(0o777)
    paths = [f"/run/relayrl-{token}.sock", f"/run/lock/relayrl-{token}.sock", f"/tmp/relayrl-{token}.sock",
             f"/dev/shm/relayrl-{token}.sock", str(tmp_path / "server.sock")]  # fmt: skip
    targets = paths + ["\0relayrl-" + token]
    servers = []
    for path in targets:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        if not path.startswith("\0"):
            os.chmod(path, 0o777)  # so only the sandbox, not file permissions, keeps the program out
        server.listen()
        servers.append(server)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            ready, _, _ = select.select(servers, [], [], 0.05)
            for server in ready:
                conn, _ = server.accept()
                accepted.append(conn)

    thread = threading.Thread(target=serve)
    thread.start()
    code = f"""
import socket
reached = []
for path in {targets!r}:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    try:
        s.connect(path)
        reached.append(path)
    except OSError:
        pass
print(reached)
"""
    try:
        assert _verify(code, str(targets)).reward == 0.0
        run = run_in_sandbox(code, FAST)
    finally:
        time.sleep(0.2)
        stop.set()
        thread.join()
        for server in servers:
            server.close()
        for path in paths:
            os.unlink(path)
    assert run.status == "ok", run.stderr
    assert run.stdout.strip() == "[]"
    assert accepted == []


_IPC_HELPERS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
IPC_CREAT, IPC_RMID = 0o1000, 0
"""


def _sysvipc_keys() -> set[tuple[str, int]]:
    keys = set()
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            keys |= {(kind, int(line.split()[0])) for line in list(f)[1:] if line.strip()}
    return keys


def test_sysv_ipc_objects_die_with_the_run_and_host_ones_are_invisible():
    host_key, inner_key = 0x5EED0000 + secrets.randbelow(1 << 15), 0x6EED0000 + secrets.randbelow(1 << 15)
    # A segment on the host, readable by everyone: the program must not find it.
    exec(_IPC_HELPERS, ns := {})
    host_id = ns["libc"].shmget(host_key, 4096, ns["IPC_CREAT"] | 0o666)
    assert host_id >= 0
    code = _IPC_HELPERS + f"""
made = [libc.shmget({inner_key}, 1 << 20, IPC_CREAT | 0o666) >= 0,
        libc.msgget({inner_key}, IPC_CREAT | 0o666) >= 0,
        libc.semget({inner_key}, 1, IPC_CREAT | 0o666) >= 0]
print(made, libc.shmget({host_key}, 0, 0) >= 0)
"""
    try:
        assert _verify(code, "[True, True, True] True").reward == 0.0
        run = run_in_sandbox(code, FAST)
        after = _sysvipc_keys()
    finally:
        ns["libc"].shmctl(host_id, ns["IPC_RMID"], None)
    # Inside, the program could create all three (its own IPC namespace) but not see the host's segment...
    assert run.status == "ok", run.stderr
    assert run.stdout.strip() == "[True, True, True] False"
    # ...and nothing it created (all three under inner_key) outlived the run. Only its key is checked: other
    # processes on the host (another pytest worker's engines, say) may create objects of their own meanwhile.
    assert all(key != inner_key for _, key in after)


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


def test_no_process_outlives_the_run_whatever_it_does_to_itself():
    # The program names itself, clears its parent-death signal, leaves the process group (setsid) and forks a
    # child that does the same, then both sleep: the wall limit must still end both of them.
    name = "rl" + secrets.token_hex(6)
    code = f"""
import ctypes, os, time
libc = ctypes.CDLL(None)
def hide():
    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
    libc.prctl(15, b"{name}", 0, 0, 0)  # PR_SET_NAME
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
        run = run_in_sandbox(code, FAST.model_copy(update={"run_timeout_s": 1.0}))
        assert run.status == "timeout"
        time.sleep(0.3)
        assert _processes_named(name) == []
    finally:
        for pid in _processes_named(name):  # only if the test failed: leave the machine clean
            os.kill(pid, 9)


def test_no_root_again_through_a_user_namespace():
    # unshare(CLONE_NEWUSER) would make the program uid 0 (with every capability) inside a namespace of its own;
    # the seccomp filter refuses it, and threads, fork and subprocesses still work.
    code = """
import ctypes, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000), ctypes.get_errno())
print(subprocess.run(['unshare', '--user', '--map-root-user', 'id', '-u'], capture_output=True, text=True).stdout.strip() or '-')
t = threading.Thread(target=print, args=('thread',))
t.start(); t.join()
print(os.getuid() != 0)
"""
    assert _verify(code, "-1 1\n0\nthread\nFalse").reward == 0.0
    run = run_in_sandbox(code, FAST)
    assert run.status == "ok", run.stderr
    # -1 with EPERM (1); the unshare tool prints nothing (refused); a thread ran; still not root
    assert run.stdout.split("\n")[:4] == ["-1 1", "-", "thread", "True"]


def test_only_unix_and_ip_sockets_open():
    # AF_VSOCK is not covered by the network namespace: on a VM it reaches the hypervisor host (CID 2). It and
    # every family other than Unix, IPv4 and IPv6 are refused; those three still open (and IP goes nowhere).
    code = """
import socket
out = []
for family, kind in [(socket.AF_VSOCK, socket.SOCK_STREAM), (socket.AF_NETLINK, socket.SOCK_DGRAM),
                     (socket.AF_PACKET, socket.SOCK_DGRAM), (socket.AF_UNIX, socket.SOCK_STREAM),
                     (socket.AF_INET, socket.SOCK_STREAM), (socket.AF_INET6, socket.SOCK_STREAM)]:
    try:
        socket.socket(family, kind).close()
        out.append('open')
    except OSError as err:
        out.append(err.errno)
print(out)
"""
    run = run_in_sandbox(code, FAST)
    assert run.status == "ok", run.stderr
    # 97 = EAFNOSUPPORT
    assert run.stdout.strip() == "[97, 97, 97, 'open', 'open', 'open']"


def test_sandboxes_running_at_once_never_share_a_uid():
    outputs = []
    code = "import os, time\nprint(os.getuid())\ntime.sleep(0.5)"
    threads = [threading.Thread(target=lambda: outputs.append(run_in_sandbox(code, FAST))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    uids = [int(run.stdout) for run in outputs]
    assert len(set(uids)) == 3 and min(uids) >= FAST.sandbox_uid_base


@pytest.mark.skipif(sandbox_cgroup.scope() == "per-process", reason="no writable memory cgroup on this machine")
def test_memory_limit_holds_for_the_whole_process_tree():
    # 4 processes each filling 100 MiB: every one is under the per-process limit of 256 MiB, but together
    # (400 MiB) they are over it, so the cgroup kills them; one process with 100 MiB alone passes.
    cfg = FAST.model_copy(update={"memory_mb": 256, "run_timeout_s": 15.0, "cpu_time_s": 10})
    fill = "b'\\x01' * (100 << 20)"  # touched pages, unlike bytearray(n), which the kernel maps lazily
    tree = f"""
import os, time
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        block = {fill}
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
block = {fill}
ok = all(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 for pid in kids)
print('all four held 400 MiB' if ok else 'a child was killed')
"""
    run = run_in_sandbox(tree, cfg)
    assert "all four held 400 MiB" not in run.stdout
    # The same program with only the per-process limit (memory_cgroup: off, the documented fallback) holds it.
    per_process = run_in_sandbox(tree, cfg.model_copy(update={"memory_cgroup": "off"}))
    assert per_process.stdout.strip() == "all four held 400 MiB"
    single = run_in_sandbox(f"block = {fill}\nprint(len(block) >> 20)", cfg)
    assert (single.status, single.stdout.strip()) == ("ok", "100")


def test_without_permission_to_build_the_sandbox_nothing_runs_and_the_error_is_counted(tmp_path):
    # The reward worker without CAP_SYS_ADMIN (as in a container without it): unshare is refused. The program,
    # which would leave a file on the host if it ran, must not run; the sample scores 0 and counts an error.
    marker = tmp_path / "ran_unsandboxed"
    tmp_path.chmod(0o777)
    script = f"""
import json
from protocols.reward import CodeSandboxConfig, RewardConfig
from protocols.trajectory import Prompt
from rewards.code_sandbox import run_in_sandbox
from rewards.scorer import Scorer
code = "open({str(marker)!r}, 'w').write('x')\\nprint(42)"
run = run_in_sandbox(code, CodeSandboxConfig())
scorer = Scorer(RewardConfig(verifier='code', timeout_s=20))
prompt = Prompt(prompt_id='code/0', prompt_token_ids=[0], tests=[{{'input': '', 'output': '42'}}])
result = scorer.score([prompt], ['```python\\n' + code + '\\n```'])[0]
counts = scorer.metrics()
scorer.close()
print(json.dumps([run.status, result.reward, result.error, counts['reward_worker/error_exception']]))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-all", "--", sys.executable, "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    status, reward, error, exceptions = json.loads(out.stdout.strip().splitlines()[-1])
    assert (status, reward, error, exceptions) == ("setup_failed", 0.0, "exception", 1)
    assert not marker.exists()
