"""A memory cgroup per sandbox run, so `reward.code.memory_mb` bounds the whole process tree of a candidate
program (RLIMIT_AS alone bounds each process, and a program may hold `max_processes` of them).

cgroup v2 when this process's cgroup can have children with the memory controller (a delegated subtree);
else cgroup v1's memory hierarchy below this process's own memory cgroup; else none (see `scope`).
"""

import errno
import itertools
import logging
import os
import signal
import time

logger = logging.getLogger(__name__)
_V2_ROOT = "/sys/fs/cgroup"
_V1_MEMORY_ROOT = "/sys/fs/cgroup/memory"
_counter = itertools.count()
_parent: tuple[str, str] | None = None  # (version, folder new run cgroups go in), found once per process
_probed = False


def _own_path(controller: str) -> str | None:
    """This process's cgroup path in the hierarchy of `controller` (`""` for the v2 unified one)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controller in (controllers.split(",") if controllers else [""]):
                return path
    return None


def _try_parent() -> tuple[str, str] | None:
    v2_own = _own_path("")
    if os.path.isfile(f"{_V2_ROOT}/cgroup.controllers") and v2_own is not None:
        base = _V2_ROOT + v2_own.rstrip("/")
        try:
            with open(f"{base}/cgroup.subtree_control") as f:
                enabled = f.read().split()
            if "memory" not in enabled:
                # Refused (EBUSY) when this cgroup holds processes itself, as it does unless the subtree
                # was delegated (systemd `Delegate=yes`) and we run in a leaf below it.
                with open(f"{base}/cgroup.subtree_control", "w") as f:
                    f.write("+memory +pids")
            return _probe("v2", base)
        except OSError:
            pass
    v1_own = _own_path("memory")
    if v1_own is not None and os.path.isdir(_V1_MEMORY_ROOT + v1_own):
        try:
            return _probe("v1", _V1_MEMORY_ROOT + v1_own.rstrip("/"))
        except OSError:
            pass
    return None


def _probe(version: str, base: str) -> tuple[str, str]:
    probe = f"{base}/relayrl-sbx-probe-{os.getpid()}"
    os.mkdir(probe)
    os.rmdir(probe)
    return version, base


def scope() -> str:
    """`cgroup v2`, `cgroup v1` (the memory limit holds for the whole process tree) or `per-process`
    (only RLIMIT_AS per process, plus the process limit)."""
    global _parent, _probed
    if not _probed:
        _parent = _try_parent()
        _probed = True
        logger.info("code sandbox memory limit: %s", f"cgroup {_parent[0]} under {_parent[1]}" if _parent else
                    "per process only (no writable memory cgroup)")  # fmt: skip
    return f"cgroup {_parent[0]}" if _parent else "per-process"


class RunCgroup:
    """One run's cgroup: memory (and, on v2, pids) limited; the harness joins it by writing `procs_file`."""

    def __init__(self, memory_bytes: int, max_processes: int):
        if scope() == "per-process":
            raise OSError("no writable memory cgroup (reward.code.memory_cgroup: required)")
        version, base = _parent
        self.path = f"{base}/relayrl-sbx-{os.getpid()}-{next(_counter)}"
        os.mkdir(self.path)
        try:
            if version == "v1":
                self._write("memory.limit_in_bytes", memory_bytes)
                self._write("memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # no swapping out of it
            else:
                self._write("memory.max", memory_bytes)
                self._write("memory.swap.max", 0, optional=True)
                # threads count as well: a little above the per-uid process limit, never the binding one
                self._write("pids.max", max_processes + 8, optional=True)
        except OSError:
            self.remove()
            raise
        self.procs_file = f"{self.path}/cgroup.procs"

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            with open(f"{self.path}/{name}", "w") as f:
                f.write(str(value))
        except FileNotFoundError:
            if not optional:
                raise

    def remove(self) -> None:
        """Kill whatever is still in the run's cgroup (nothing, normally: the pid namespace died with its
        process 1), then remove it."""
        for attempt in range(50):
            try:
                with open(f"{self.path}/cgroup.procs") as f:
                    for pid in f.read().split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as err:
                if err.errno != errno.EBUSY:
                    break
                # busy for a moment while the kernel finishes tearing the killed processes down
                time.sleep(0.002 * (attempt + 1))
        logger.warning("could not remove the sandbox cgroup %s; remove it by hand once it is empty", self.path)
