"""Runs inside the code sandbox as root, builds the sandbox's view of the system, then forks: the child drops to
an unprivileged uid and runs the candidate program, the parent stays as a root supervisor.

Started by rewards/code_sandbox.py as `unshare --net --mount --pid --ipc --uts --fork ... python -I -S <this>
JOB_FD STATUS_FD` with an allow-listed environment, so it is process 1 of fresh network, mount, pid, IPC and
UTS namespaces: when it exits (the program ended, or the launcher was killed), every process the program forked
dies with it. Standard library only; nothing from the project is importable here.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

SETUP_FAILED = 121  # exit status the parent reads as "the sandbox itself could not start"
READY = b"R"  # written to the status pipe once the sandbox is built, just before the program runs
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MNT_DETACH = 2
_PR_SET_NO_NEW_PRIVS = 38
_KEYCTL_JOIN_SESSION_KEYRING = 1
_SYSCALLS = {  # (pivot_root, keyctl) by architecture; glibc wraps neither
    "x86_64": (155, 250), "aarch64": (41, 219), "ppc64le": (203, 271), "s390x": (217, 280),
}  # fmt: skip
_DEVICES = ("null", "zero", "full", "random", "urandom")
# seccomp: (audit arch, unshare, clone, clone3, socket) by architecture, for the filter below.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, 272, 56, 435, 41), "aarch64": (0xC00000B7, 97, 220, 435, 198)}
_CLONE_NEWUSER = 0x10000000
# Socket families a program may open: Unix (its own folder only), IPv4 and IPv6 (its own network namespace,
# loopback down). Others are refused: AF_VSOCK, for one, reaches the hypervisor host whatever the namespace.
_SOCKET_FAMILIES = (1, 2, 10)
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _EAFNOSUPPORT, _ENOSYS = 1, 97, 38
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ok: bool, what: str) -> None:
    if not ok:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    rc = _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                     data.encode() if data else None)  # fmt: skip
    _check(rc == 0, f"mount {source} on {target}")


def _bind_readonly(source: str, target: str) -> None:
    # A bind takes the source's flags; read-only (and nosuid, nodev) needs a second, remounting call.
    # Not recursive: mounts below an allowed path stay hidden (an allow-list, so hiding is the safe side).
    _mount(source, target, None, _MS_BIND)
    _mount("none", target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _staging_dir(sources: list[str]) -> str:
    """An existing folder to mount the new root on; none of the allowed paths may lie under it, since the
    mount hides what it covers (in this mount namespace only: the host's folder is untouched)."""
    for candidate in ("/mnt", "/tmp", "/media", "/srv", "/opt"):
        if os.path.isdir(candidate) and not os.path.islink(candidate):
            if not any(s == candidate or s.startswith(candidate + os.sep) for s in sources):
                return candidate
    raise OSError(f"no folder to build the sandbox root on: every candidate holds one of {sources}")


def _add_path(root: str, path: str) -> None:
    """Make host `path` visible at the same place under `root`: a symlink is copied, a folder or file is bound
    read-only. Missing paths are skipped."""
    if not os.path.lexists(path):
        return
    inside = root + path
    os.makedirs(os.path.dirname(inside), mode=0o755, exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(inside):
            os.symlink(os.readlink(path), inside)
        return
    if os.path.isdir(path):
        os.makedirs(inside, mode=0o755, exist_ok=True)
    elif not os.path.exists(inside):
        open(inside, "w").close()
    _bind_readonly(path, inside)


def _build_dev(root: str) -> None:
    """A /dev with only the harmless character devices (host /dev holds ttys, disks and sockets such as
    /dev/log), plus a private, empty /dev/shm."""
    dev = root + "/dev"
    os.mkdir(dev, 0o755)
    _mount("tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,mode=755")
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{dev}/{name}", "w").close()
            _mount(f"/dev/{name}", f"{dev}/{name}", None, _MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm", 0o1777)
    _mount("tmpfs", f"{dev}/shm", "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=1777")
    _mount("none", dev, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NOEXEC)


def _build_root(job: dict) -> None:
    """Replace the filesystem with an allow-list view and pivot into it:
    - `readonly_paths`, the Python prefix and its executable: read-only binds at their host paths;
    - /tmp: a fresh tmpfs of `tmpfs_mb`, the program's working folder and the only place it can write
      (with /dev/shm);
    - /run (and /var/run, a link to it), /dev/shm: private and empty; /proc: this pid namespace's own;
    - everything else (home folders, data, /var, host sockets under /run or /tmp) does not exist.
    """
    executable = os.path.realpath(sys.executable)
    sources = [os.path.realpath(sys.base_prefix)]
    if not executable.startswith(sources[0] + os.sep):
        sources.append(os.path.dirname(executable))
    for path in job["readonly_paths"]:
        if not any(path == s or path.startswith(s + os.sep) for s in sources):
            sources.append(path)
    root = _staging_dir(sources)
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
    for path in sources:
        _add_path(root, path)
    os.makedirs(root + "/etc", mode=0o755, exist_ok=True)
    uid = job["uid"]
    with open(root + "/etc/passwd", "w") as f:
        f.write(f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n")
    with open(root + "/etc/group", "w") as f:
        f.write(f"root:x:0:\nsandbox:x:{uid}:\n")
    os.mkdir(root + "/proc", 0o555)
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    _build_dev(root)
    os.mkdir(root + "/tmp", 0o1777)
    _mount("tmpfs", root + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={job['tmpfs_mb']}m,mode=1777")
    os.mkdir(root + "/run", 0o755)
    _mount("tmpfs", root + "/run", "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "size=4k,mode=755")
    os.makedirs(root + "/var", mode=0o755, exist_ok=True)
    os.symlink("/run", root + "/var/run")
    _mount("none", root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    # pivot_root(".", "."): the old root ends up on top of the new one and is then detached, so nothing of
    # the host's tree stays reachable (unlike chroot, which keeps it one `..` away for a privileged process).
    pivot_root = _syscall_number(0)
    os.chdir(root)
    _check(_libc.syscall(pivot_root, b".", b".") == 0, "pivot_root")
    _check(_libc.umount2(b".", _MNT_DETACH) == 0, "umount old root")
    os.chdir("/")


def _syscall_number(index: int) -> int:
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise OSError(f"the sandbox knows no syscall numbers for {machine}; add them to _SYSCALLS")
    return _SYSCALLS[machine][index]


def _seccomp_program(arch: int, unshare: int, clone: int, clone3: int, sock: int) -> list[tuple[int, int, int, int]]:
    """Classic BPF over `struct seccomp_data` (nr at 0, arch at 4, args[0] at 16). Jumps are written as labels
    and resolved here: a jump goes to (its own index + 1 + jt or jf)."""
    code = [
        ("ld", 4), ("jeq", arch, "nr", "deny"),
        ("nr:",), ("ld", 0), ("jge", 0x40000000, "deny", "native"),  # x32 ABI on x86_64
        ("native:",), ("jeq", clone3, "nosys", "u"),
        ("u:",), ("jeq", unshare, "flags", "c"),
        ("c:",), ("jeq", clone, "flags", "s"),
        ("s:",), ("jeq", sock, "family", "allow"),
        ("flags:",), ("ld", 16), ("jset", _CLONE_NEWUSER, "deny", "allow"),
        ("family:",), ("ld", 16),
        *[item for i, fam in enumerate(_SOCKET_FAMILIES) for item in (("jeq", fam, "allow", f"f{i}"), (f"f{i}:",))],
        ("ret", _RET_ERRNO | _EAFNOSUPPORT),
        ("nosys:",), ("ret", _RET_ERRNO | _ENOSYS),
        ("allow:",), ("ret", _RET_ALLOW),
        ("deny:",), ("ret", _RET_ERRNO | _EPERM),
    ]
    return _assemble(code)


def _assemble(code: list[tuple]) -> list[tuple[int, int, int, int]]:
    labels, program = {}, []
    for item in code:
        if item[0].endswith(":"):
            labels[item[0][:-1]] = len(program)
        else:
            program.append(item)
    ops = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "jset": 0x45, "ret": 0x06}
    out = []
    for pos, item in enumerate(program):
        if item[0] in ("ld", "ret"):
            out.append((ops[item[0]], 0, 0, item[1]))
        else:
            jt, jf = (labels[t] - pos - 1 for t in item[2:4])
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError(f"seccomp jump out of range at {pos}")
            out.append((ops[item[0]], jt, jf, item[1]))
    return out


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _install_seccomp() -> None:
    """A seccomp filter: `unshare` and `clone` with CLONE_NEWUSER fail with EPERM, `clone3` (whose flags a
    filter cannot read) with ENOSYS, so glibc falls back to `clone`; sockets other than Unix, IPv4 and IPv6
    fail with EAFNOSUPPORT; syscalls of another ABI (i386, x32) fail. Inside a user namespace of its own the
    program would be uid 0 with every capability there: no way out of the read-only binds, but a large kernel
    surface for nothing a test needs."""
    machine = os.uname().machine
    if machine not in _SECCOMP_ARCH:
        return  # no numbers for this architecture: namespaces, uid and limits still hold
    program = _seccomp_program(*_SECCOMP_ARCH[machine])
    filters = (_SockFilter * len(program))(*[_SockFilter(*ins) for ins in program])
    prog = _SockFprog(len(program), filters)
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0, "seccomp filter")


def _join_cgroup(procs_file: str) -> None:
    """Move this process (and so every process it forks) into the run's memory cgroup."""
    with open(procs_file, "w") as f:
        f.write("0")


def _limit_and_drop(job: dict) -> None:
    mem = job["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_time_s"], job["cpu_time_s"] + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (job["max_processes"], job["max_processes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (job["max_output_bytes"], job["max_output_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Setuid binaries (mount, su) must not give root back.
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "prctl(PR_SET_NO_NEW_PRIVS)")
    _install_seccomp()
    uid = job["uid"]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    # The caller's session keyring is still attached (and so readable); join a new, empty one. Where keyctl
    # is refused (a seccomp filter, as in Docker's default profile), the program cannot reach keys either.
    if _libc.syscall(_syscall_number(1), _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        if ctypes.get_errno() not in (1, 38):  # EPERM, ENOSYS
            _check(False, "keyctl(JOIN_SESSION_KEYRING)")
    os.chdir("/tmp")


def _run(job: dict) -> int:
    namespace = {"__name__": "__main__" if job["mode"] == "stdio" else "solution", "__builtins__": __builtins__}
    try:
        exec(compile(job["code"], "solution.py", "exec"), namespace)
        if job["mode"] == "call":
            fn = _find_function(namespace, job["fn_name"])
            result = fn(*job.get("args", []), **job.get("kwargs", {}))
            os.write(job["result_fd"], json.dumps(result, default=repr).encode())
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if job["mode"] == "call":
            return 1  # a function-call test must return a value, not exit
        return code
    except BaseException:  # noqa: BLE001 - the candidate's own failure, whatever it is, is reported as such
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
    return 0


def _find_function(namespace: dict, fn_name: str):
    """`fn_name` is a top-level function, or a method of a `Solution` class (LeetCode style)."""
    if fn_name in namespace and callable(namespace[fn_name]):
        return namespace[fn_name]
    solution = namespace.get("Solution")
    if solution is not None and hasattr(solution, fn_name):
        return getattr(solution(), fn_name)
    raise NameError(f"the program defines no function {fn_name!r}")


def _read_job(fd: int) -> dict:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def _supervise(child: int) -> int:
    """Process 1 stays root and does not run the program: it reaps orphans and exits with the program's status.
    Its parent-death signal (set by `unshare --kill-child`) survives because its credentials never change, so
    killing the launcher always kills it, and with it the whole pid namespace, whatever the program does to
    itself (setsid, clearing its own parent-death signal, ignoring signals)."""
    while True:
        pid, status = os.wait()
        if pid == child:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


def main() -> None:
    status_fd = int(sys.argv[2])
    try:
        job = _read_job(int(sys.argv[1]))
        if job["cgroup_procs"]:
            _join_cgroup(job["cgroup_procs"])
        _build_root(job)
        child = os.fork()
    except (OSError, ValueError, KeyError) as err:
        sys.stderr.write(f"sandbox setup failed: {err}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)
    if child:
        os.close(status_fd)
        os.close(job["result_fd"])
        os._exit(_supervise(child))
    try:
        _limit_and_drop(job)
        os.write(status_fd, READY)
        os.close(status_fd)
    except (OSError, ValueError, KeyError) as err:
        sys.stderr.write(f"sandbox setup failed: {err}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)
    status = _run(job)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
