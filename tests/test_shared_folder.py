"""The run folder is one folder for every learner and critic rank (checkpoint pieces, the final model): the
driver's check before the first step. Several raylets on one machine share its disk, so a node with its own
disk is played by a rank that reads the run folder's path under another root, as it would on that disk."""

import os

import pytest
import ray

from cluster.shared_folder import PROBE, RunFolderNotShared, check_run_folder_shared
from learner.rank_setup import read_probe

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=0)
class ProbeReader:
    """A rank's `read_probe`; with `own_disk`, the path is looked up under that folder instead of `/`."""

    def __init__(self, own_disk: str | None = None) -> None:
        self.own_disk = own_disk

    def read_probe(self, path: str) -> tuple[str, str | None]:
        return read_probe(self.own_disk + path if self.own_disk else path)


def test_ranks_that_share_the_folder_pass_and_the_probe_is_removed(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    ranks = [ProbeReader.remote() for _ in range(2)]
    check_run_folder_shared(run_dir, {"learner": ranks, "critic": [ProbeReader.remote()]}, timeout_s=60)
    assert run_dir.is_dir() and not (run_dir / PROBE).exists()


def test_a_rank_on_its_own_disk_is_named_with_its_host_and_the_fix(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    elsewhere = tmp_path / "node_b_disk"
    os.makedirs(elsewhere)
    ranks = [ProbeReader.remote(), ProbeReader.remote(str(elsewhere))]
    with pytest.raises(RunFolderNotShared, match=r"learner rank 1 on host \S+ cannot read the run folder "
                                                 r"output_dir='.*/run' .*\(no such file at .*\): .*NFS"):
        check_run_folder_shared(run_dir, {"learner": ranks}, timeout_s=60)
    assert not (run_dir / PROBE).exists()
    # a stale copy of the folder on that disk (same path, old contents) is caught too: the token differs
    (elsewhere / str(run_dir).lstrip("/")).mkdir(parents=True)
    (elsewhere / str(run_dir).lstrip("/") / PROBE).write_text("an older run's token")
    with pytest.raises(RunFolderNotShared, match=r"learner rank 1 .*\(another file at"):
        check_run_folder_shared(run_dir, {"learner": ranks}, timeout_s=60)
