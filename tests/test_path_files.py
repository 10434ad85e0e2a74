"""benchmarks/path_files.py's pure parts: which paths are library files, a process's kind from its command line,
and the per-process table the count is read from."""

from pathlib import Path

from benchmarks.path_files import (PACKAGES, coverage_rc, data_file_pid, library_file, markdown, path_table,
                                   process_kind)

ROOT = Path("/repo")


def test_library_files_are_the_installed_packages_only():
    assert library_file("/repo/actors/decode_loop.py", ROOT) == "actors/decode_loop.py"
    assert library_file("/repo/learner/policy_losses.py", ROOT) == "learner/policy_losses.py"
    assert library_file("/repo/tests/test_x.py", ROOT) is None
    assert library_file("/repo/benchmarks/path_files.py", ROOT) is None
    assert library_file("/venv/lib/python3.11/site-packages/ray/actor.py", ROOT) is None
    assert library_file("/repo/setup.py", ROOT) is None  # the root itself holds no package file
    assert library_file("/repo/runs/probe/sitecustomize.py", ROOT) is None


def test_packages_come_from_pyproject():
    assert {"protocols", "cluster", "actors", "learner", "rewards", "weights", "gateway"} <= set(PACKAGES)
    assert "tests" not in PACKAGES and "benchmarks" not in PACKAGES


def test_process_kind_names_actors_driver_and_verifiers():
    assert process_kind(["ray::RolloutWorker.run"]) == "rollout worker"
    assert process_kind(["ray::LearnerRank"]) == "learner rank"
    assert process_kind(["ray::ControllerActor.wait_batch"]) == "controller"
    assert process_kind(["ray::SomeNewActor.method"]) == "SomeNewActor"
    assert process_kind(["/venv/bin/python", "-m", "cli.main", "train"]) == "driver"
    assert process_kind(["/venv/bin/python", "-m", "rewards.scorer", "5", "6"]) == "verifier process"
    assert process_kind(["/venv/bin/python", "dashboard.py"]) == "other: /venv/bin/python"


def test_path_table_counts_distinct_library_files_and_kinds():
    found = [
        ("driver", {"/repo/cluster/trainer.py": {10, 11}, "/repo/learner/prepare.py": {5},
                    "/venv/site-packages/tqdm/std.py": {1, 2}}),
        ("learner rank", {"/repo/learner/policy_losses.py": {7}, "/repo/learner/prepare.py": {5, 6}}),
        ("learner rank", {"/repo/learner/policy_losses.py": {8}, "/repo/weights/object_store.py": {3}}),  # rank 1
        ("other: python", {"/venv/site-packages/ray/dashboard.py": {1}}),  # no library file: left out
        ("driver", {"/repo/cluster/supervisor.py": set()}),  # measured, but no line ran in the window
    ]
    table = path_table(found, ROOT)
    # trainer, prepare, policy_losses, object_store: 4 distinct files in 2 kinds
    assert table["count"] == 4 and table["num_kinds"] == 2
    assert table["processes"] == 3  # the driver and the two ranks: the other two entries ran no library line
    assert table["per_kind"] == {"driver": ["cluster/trainer.py", "learner/prepare.py"],
                                 "learner rank": ["learner/policy_losses.py", "learner/prepare.py",
                                                  "weights/object_store.py"]}
    # prepare.py ran line 5 in the driver and lines 5 and 6 in the rank: 2 distinct lines
    assert table["files"]["learner/prepare.py"] == {"kinds": ["driver", "learner rank"], "lines_run": 2}
    assert table["files"]["learner/policy_losses.py"] == {"kinds": ["learner rank"], "lines_run": 2}
    text = markdown(table, {"learner/prepare.py": 120})
    assert "| `learner/prepare.py` | 2 | 120 | driver, learner rank |" in text and text.startswith("4 library files")


def test_data_file_pid_reads_coverage_parallel_names():
    assert data_file_pid(".coverage.vm.pid10351.XFvpMFhx.H7fsPYszBVfh") == 10351
    assert data_file_pid(".coverage") is None


def test_coverage_rc_measures_the_repository_in_every_process():
    rc = coverage_rc(Path("/tmp/probe/data"), ROOT)
    assert "parallel = True" in rc and "source = /repo" in rc and "data_file = /tmp/probe/data/.coverage" in rc
