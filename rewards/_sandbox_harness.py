"""Runs inside the code sandbox as root, then drops to an unprivileged uid and runs the candidate program.

Started by rewards/code_sandbox.py as `unshare --net --mount --pid --fork ... python -I -S <this> job.json`,
so it is process 1 of a fresh network, mount and pid namespace: when it exits, every process the program
forked dies with it. Standard library only; nothing from the project is importable here.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

SETUP_FAILED = 121  # exit status the parent reads as "the sandbox itself could not start"
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC = 2, 4, 4096, 16384
_PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _isolate_filesystem(tmpfs_mb: int, hide_paths: list[str]) -> None:
    """Fresh tmpfs at /tmp, /var/tmp and /dev/shm; empty folders over `hide_paths`, except the Python prefix."""
    tmp_opts = f"size={tmpfs_mb}m,mode=1777"
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, tmp_opts)
    for path in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=1777")
    prefix = os.path.realpath(sys.base_prefix)
    for hidden in hide_paths:
        hidden = os.path.realpath(hidden)
        if not os.path.isdir(hidden):
            continue
        keep = prefix.startswith(hidden + os.sep)
        if keep:
            # Stage the interpreter's prefix, cover the folder, then put the prefix back at the same path.
            os.mkdir("/tmp/.prefix")
            _mount(prefix, "/tmp/.prefix", None, _MS_BIND | _MS_REC)
        _mount("tmpfs", hidden, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=755")
        if keep:
            os.makedirs(prefix)
            _mount("/tmp/.prefix", prefix, None, _MS_BIND | _MS_REC)
            _libc.umount2(b"/tmp/.prefix", 2)
            os.rmdir("/tmp/.prefix")


def _limit_and_drop(job: dict) -> None:
    mem = job["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_time_s"], job["cpu_time_s"] + 1))
    resource.setrlimit(resource.RLIMIT_NPROC, (job["max_processes"], job["max_processes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (job["max_output_bytes"], job["max_output_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Setuid binaries (mount, su) must not give root back.
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    uid = job["uid"]
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    os.chdir("/tmp")
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"})


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


def main() -> None:
    try:
        with open(sys.argv[1]) as f:
            job = json.load(f)
        _isolate_filesystem(job["tmpfs_mb"], job["hide_paths"])
        _limit_and_drop(job)
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
