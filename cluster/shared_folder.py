"""The run folder must be one folder for every learner and critic rank: they write their DeepSpeed checkpoint
pieces into it, and rank 0 writes the final model there. On one machine it always is; across nodes it needs a
shared filesystem (NFS, Lustre, a mounted bucket). The driver checks it before the first step instead of
finding a checkpoint split over the nodes' local disks at `--resume`.
"""

import secrets
import socket
from pathlib import Path

import ray

PROBE = ".relayrl_shared_probe"
"""The file the driver writes into the run folder for the ranks to read back (removed after the check)."""


class RunFolderNotShared(RuntimeError):
    """A learner or critic rank cannot read the run folder the driver writes."""


def check_run_folder_shared(run_dir: str | Path, ranks: dict[str, list], timeout_s: float) -> None:
    """Write a random token into `run_dir` and have every rank (`{role: [actor with read_probe]}`) read it back
    through the same absolute path; raise RunFolderNotShared naming the first rank that cannot."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    probe, token = run_dir / PROBE, secrets.token_hex(16)
    probe.write_text(token)
    try:
        asked = [(role, index, actor.read_probe.remote(str(probe))) for role, actors in ranks.items()
                 for index, actor in enumerate(actors)]
        answers = ray.get([ref for _, _, ref in asked], timeout=timeout_s)
    finally:
        probe.unlink(missing_ok=True)
    for (role, index, _), (host, seen) in zip(asked, answers):
        if seen != token:
            raise RunFolderNotShared(
                f"{role} rank {index} on host {host} cannot read the run folder output_dir={str(run_dir)!r} that "
                f"the driver writes on host {socket.gethostname()} ({'no such file' if seen is None else 'another file'}"
                f" at {probe}): its checkpoint pieces and the final model would land on that node's own disk. Put "
                "output_dir on a filesystem every node mounts at the same path (NFS, Lustre, a mounted bucket)")
