"""The library files a trajectory's path crosses (issue 29's goal): the files whose code runs in any process of a
single-turn GRPO job during its steady-state steps, counted with coverage.py in every process. Measures only;
docs/trajectory_path.md reads the figures.

Runs `relayrl train` (the addition demo, what `make train` runs, or `--config`) in its own process with coverage
started in every Python process of the job at interpreter start (coverage's own .pth file reads
COVERAGE_PROCESS_START; a `sitecustomize.py` put first on PYTHONPATH, which Ray's workers and the verifier
processes inherit, adds a thread that follows a phase file). This script watches metrics.jsonl and writes the
phase: "steady" once `--warm-steps` steps are logged, "end" after `--steady-steps` more, so every process records
the lines it runs in that window under the coverage context "steady" (a context switch applies to all of a process's
threads), flushes them to its data file, and names itself. Startup, warm-up, the evaluations, the final save and
the shutdown fall outside the window.

    python benchmarks/path_files.py --warm-steps 3 --steady-steps 4 --out runs/path_files [key=value ...]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = tuple(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
"""The library: the packages pyproject.toml installs (tests/, benchmarks/ and site-packages are not in it)."""

KINDS = {"ControllerActor": "controller", "RolloutWorker": "rollout worker", "RewardWorker": "reward worker",
         "LearnerRank": "learner rank", "ReferenceWorker": "reference worker", "CriticRank": "critic rank",
         "TeacherWorker": "teacher worker"}
"""Ray actor classes by the name the report gives their processes; another class keeps its own name."""

# Runs at the start of every Python process of the job (first on PYTHONPATH). Coverage is already running there
# (its .pth file); the thread switches the context on each change of the phase file it sees after its start, so
# a process that starts inside the window (a replacement, a prestarted Ray worker) records nothing as steady.
SITECUSTOMIZE = '''\
import json, os, sys, threading, time

import coverage

coverage.process_startup()  # a no-op where coverage's .pth file started it


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _follow(cov, path, folder):
    seen = _read(path)
    while True:
        time.sleep(0.05)
        phase = _read(path)
        if phase == seen:
            continue
        seen = phase
        if phase == "steady":
            cov.switch_context("steady")
        elif phase == "end":
            cov.switch_context("")  # writes the window's lines to this process's data file
            with open(os.path.join(folder, f"proc.{os.getpid()}.json"), "w") as f:
                json.dump({"pid": os.getpid(), "cmdline": _cmdline(), "data_file": cov.get_data().data_filename()}, f)
            return


def _cmdline():
    try:
        with open("/proc/self/cmdline", "rb") as f:  # Ray titles an actor's process `ray::Class.method`
            return [part.decode(errors="replace") for part in f.read().split(b"\\0") if part]
    except OSError:
        return list(sys.argv)


_cov = coverage.Coverage.current()
if _cov is not None and os.environ.get("PATH_FILES_PHASE"):
    threading.Thread(target=_follow, args=(_cov, os.environ["PATH_FILES_PHASE"], os.environ["PATH_FILES_DIR"]),
                     name="path-files-phase", daemon=True).start()
'''


def coverage_rc(data_dir: Path, root: Path) -> str:
    """The coverage config every process starts with: one data file per process, the repository measured."""
    return ("[run]\n"
            "parallel = True\n"
            f"data_file = {data_dir / '.coverage'}\n"
            f"source = {root}\n"
            "concurrency = thread\n"
            "disable_warnings = module-not-imported, no-data-collected, module-not-measured, already-imported\n")


def library_file(path: str, root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> str | None:
    """`path` relative to the repository (`actors/decode_loop.py`) if it is a file of a library package, else None
    (tests, benchmarks, installed packages, the probe's own sitecustomize)."""
    try:
        rel = Path(path).resolve().relative_to(root.resolve())
    except ValueError:
        return None
    return rel.as_posix() if len(rel.parts) >= 2 and rel.parts[0] in packages and rel.suffix == ".py" else None


def process_kind(cmdline: list[str]) -> str:
    """A process's role from its command line: the driver, a verifier process, or a Ray actor by its class."""
    text = " ".join(cmdline)
    if cmdline and cmdline[0].startswith("ray::"):
        name = cmdline[0][5:].split(".")[0].split(" ")[0]
        return KINDS.get(name, name)
    if "cli.main" in text:
        return "driver"
    if "rewards.scorer" in text:
        return "verifier process"
    return "other: " + (cmdline[0] if cmdline else "?")


def path_table(lines_by_process: list[tuple[str, dict[str, set[int]]]], root: Path = REPO,
               packages: tuple[str, ...] = PACKAGES) -> dict:
    """[(process kind, {path: line numbers run in the window})] -> the count of distinct library files, the files of
    each kind, and per file the kinds that ran it and how many of its lines ran (in any process). Paths outside
    the library are dropped; kinds and processes that ran none are left out."""
    per_kind: dict[str, set[str]] = defaultdict(set)
    lines_run: dict[str, set[int]] = defaultdict(set)
    processes = 0
    for kind, lines in lines_by_process:
        ran = False
        for path, numbers in lines.items():
            rel = library_file(path, root, packages)
            if rel and numbers:
                per_kind[kind].add(rel)
                lines_run[rel] |= set(numbers)
                ran = True
        processes += ran
    files = {rel: {"kinds": sorted(kind for kind, ran in per_kind.items() if rel in ran),
                   "lines_run": len(lines_run[rel])} for rel in sorted(lines_run)}
    return {"count": len(files), "num_kinds": len(per_kind), "processes": processes,
            "per_kind": {kind: sorted(ran) for kind, ran in sorted(per_kind.items())}, "files": files}


def markdown(table: dict, file_lines: dict[str, int] | None = None) -> str:
    """The per-file table (file, lines run in the window, lines in the file, process kinds) and the files of each
    kind, as markdown."""
    file_lines = file_lines or {}
    lines = [f"{table['count']} library files ran in {table['num_kinds']} process kinds during the steady steps.", "",
             "| file | lines run | lines in the file | process kinds |", "| --- | ---: | ---: | --- |"]
    lines += [f"| `{rel}` | {row['lines_run']} | {file_lines.get(rel, '')} | {', '.join(row['kinds'])} |"
              for rel, row in table["files"].items()]
    lines += ["", "| process kind | files |", "| --- | --- |"]
    lines += [f"| {kind} ({len(files)}) | {', '.join(f'`{rel}`' for rel in files)} |"
              for kind, files in table["per_kind"].items()]
    return "\n".join(lines) + "\n"


def steady_lines(data_file: Path) -> dict[str, set[int]]:
    """{measured file: line numbers} of one process's data file in the "steady" context."""
    from coverage import CoverageData

    data = CoverageData(basename=str(data_file))
    data.read()
    data.set_query_contexts(["^steady$"])
    return {path: set(lines) for path in data.measured_files() if (lines := data.lines(path))}


def data_file_pid(name: str) -> int | None:
    """The process id in a coverage data file's name (`.coverage.HOST.pid1234.XABC`), or None."""
    match = re.search(r"\.pid(\d+)\.", name)
    return int(match.group(1)) if match else None


def collect(probe: Path) -> tuple[list[tuple[str, dict[str, set[int]]]], list[str]]:
    """[(kind, steady lines)] of every process that recorded some, and the data files no process named."""
    kinds = {}
    for side in probe.glob("proc.*.json"):
        record = json.loads(side.read_text())
        kinds[record["pid"]] = process_kind(record["cmdline"])
    found, unnamed = [], []
    for data_file in sorted((probe / "data").glob(".coverage.*")):
        lines = steady_lines(data_file)
        if lines:
            kind = kinds.get(data_file_pid(data_file.name))
            if kind is None:
                unnamed.append(data_file.name)
            found.append((kind or "unnamed", lines))
    return found, unnamed


def write_phase(path: Path, phase: str) -> None:
    """Replace the phase file at once, so that a process never reads it half written."""
    path.with_suffix(".tmp").write_text(phase)
    os.replace(path.with_suffix(".tmp"), path)


def logged_steps(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip()) if path.is_file() else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-steps", type=int, default=3, help="steps before the window (warm-up)")
    parser.add_argument("--steady-steps", type=int, default=4, help="steps measured")
    parser.add_argument("--tail-steps", type=int, default=2, help="steps after the window, before the job ends")
    parser.add_argument("--config", default=None, help="a run config (default: the demo's, as `make train`)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before the job is given up")
    parser.add_argument("--out", default="runs/path_files")
    parser.add_argument("--report-only", action="store_true", help="read the data of the last run in --out again")
    parser.add_argument("overrides", nargs="*", help="run overrides, section.key=value")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    probe = out / "probe"
    if not args.report_only:
        run_job(args, out, probe)
    report(out, probe, json.loads((probe / "marks.json").read_text()))


def run_job(args: argparse.Namespace, out: Path, probe: Path) -> None:
    """Run the job with coverage in every process, and move the phase file through the window."""
    if probe.exists():
        for stale in [*(probe / "data").glob(".coverage*"), *probe.glob("*.json")]:  # proc.*.json, marks.json
            stale.unlink()
    (probe / "data").mkdir(parents=True, exist_ok=True)
    (probe / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (probe / "coverage.rc").write_text(coverage_rc(probe / "data", REPO))
    phase = probe / "phase"
    write_phase(phase, "")
    steps = args.warm_steps + args.steady_steps + args.tail_steps
    env = {**os.environ, "COVERAGE_PROCESS_START": str(probe / "coverage.rc"), "PATH_FILES_PHASE": str(phase),
           "PATH_FILES_DIR": str(probe),
           "PYTHONPATH": os.pathsep.join([str(probe), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = out / "run"
    cmd = [sys.executable, "-m", "cli.main", "train", *(["--config", args.config] if args.config else []),
           "--output-dir", str(run), f"train.steps={steps}", "train.eval_every=0", "logging.plots=false",
           *args.overrides]
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    log_path = out / "relayrl.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    marks = {}
    while job.poll() is None:
        done = logged_steps(metrics)
        if "steady" not in marks and done >= args.warm_steps:
            write_phase(phase, "steady")
            marks["steady"] = done
        if "end" not in marks and done >= args.warm_steps + args.steady_steps:
            write_phase(phase, "end")
            marks["end"] = done
        if time.monotonic() - start > args.timeout:
            job.kill()
            raise SystemExit(f"the job ran past --timeout {args.timeout:g} s; see {log_path}")
        time.sleep(0.05)
    if job.returncode != 0 or "end" not in marks:
        raise SystemExit(f"the job failed or ended before the window closed (exit {job.returncode}); see {log_path}")
    marks.update({"steps": steps, "command": cmd[1:]})
    (probe / "marks.json").write_text(json.dumps(marks))


def report(out: Path, probe: Path, marks: dict) -> None:
    """Read every process's data file, write path_files.json and .md under `out`, and print the table."""
    found, unnamed = collect(probe)
    table = path_table(found)
    table.update({"window": marks, "unnamed_data_files": unnamed})
    (out / "path_files.json").write_text(json.dumps(table, indent=1))
    file_lines = {rel: len((REPO / rel).read_text().splitlines()) for rel in table["files"]}
    (out / "path_files.md").write_text(markdown(table, file_lines))
    for rel, row in table["files"].items():
        print(f"  {rel:40s} {row['lines_run']:4d} of {file_lines[rel]:4d} lines  {', '.join(row['kinds'])}")
    for kind, files in table["per_kind"].items():
        print(f"{kind}: {len(files)} files")
    if unnamed:
        print(f"data files with steady lines from processes that did not name themselves: {unnamed}")
    print(f"library files on the path: {table['count']} in {table['num_kinds']} process kinds "
          f"({table['processes']} processes, steps {marks['steady'] + 1} to {marks['end']} of {marks['steps']})")


if __name__ == "__main__":
    main()
