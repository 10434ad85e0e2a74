"""CPU seconds per training step of each process of a `relayrl train` job, and where the rollout worker's time goes
(issue 30, item 2). Measures only; docs/peers.md reads the figures.

Runs `relayrl train` (the demo's config, or `--config`) in its own process with `train.eval_every=0`, and samples the
CPU time (user + system) of every process below it every 0.25 s: the driver, Ray's GCS, dashboard and log monitor,
and each actor by its class (Ray titles an actor's process `ray::Class.method`). The window runs from the end of
the held-out evaluation before training to the progress bar's last step, so start-up is left out. CPU seconds
measure the work a step costs even on a shared machine, where wall time stretches with the load.

With `--spy-seconds N`, py-spy samples the driver and each actor for N seconds in the middle of the run (50 Hz,
idle threads left out) and the report lists, per process, the busy seconds and the functions under which the time
went (a function counts once per sample, callers included).

    python benchmarks/actor_cpu.py --steps 150 --spy-seconds 30 --out runs/bench_actor_cpu [key=value ...]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BEGIN = "held-out accuracy before training"
SPIED = ("RolloutWorker", "LearnerRank", "ControllerActor", "RewardWorker")
RATE = 50


def process_name(proc: psutil.Process) -> str:
    """An actor's class (`ray::RolloutWorker.run` -> RolloutWorker), or what the process is for Ray."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return ""
    title = cmd[0] if cmd and cmd[0].startswith("ray::") else proc.name()  # the kernel's name: 15 characters
    if title.startswith("ray::"):
        name = title[5:].split(".")[0].split(" ")[0]
        return next((full for full in SPIED if full.startswith(name)), name)
    text = " ".join(cmd)
    for part in ("cli.main", "gcs_server", "/raylet", "dashboard/agent", "dashboard", "log_monitor", "monitor.py",
                 "runtime_env", "default_worker"):
        if part in text:
            return part.strip("/")
    return proc.name()


def spy(pids: dict[str, int], seconds: int, out: Path) -> dict[str, dict]:
    """py-spy on each process at once -> {name: {busy_s, top: [(seconds, function, file)]}}."""
    exe = Path(sys.executable).parent / "py-spy"
    jobs = {name: subprocess.Popen([str(exe), "record", "-p", str(pid), "-r", str(RATE), "-d", str(seconds),
                                    "--nonblocking", "-f", "raw", "-o", str(out / f"{name}.stacks")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()}
    report = {}
    for name, job in jobs.items():
        job.wait()
        inclusive, total = Counter(), 0
        path = out / f"{name}.stacks"
        for line in path.read_text().splitlines() if path.is_file() else []:
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            total += int(count)
            frames = {(m.group(1), m.group(2).split("site-packages/")[-1].replace(str(REPO) + "/", ""))
                      for m in (re.match(r"(.*) \((.*?):\d+\)", f) for f in stack.split(";")) if m}
            for frame in frames:
                inclusive[frame] += int(count)
        report[name] = {"busy_s": total / RATE, "window_s": seconds,
                        "top": [(c / RATE, f, where) for (f, where), c in inclusive.most_common(60)]}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--config", default=None, help="a run config (default: the demo's)")
    parser.add_argument("--spy-seconds", type=int, default=0, help="py-spy every actor for this long (0: off)")
    parser.add_argument("--out", default="runs/bench_actor_cpu")
    parser.add_argument("overrides", nargs="*", help="run overrides, section.key=value")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    end = f"{args.steps}/{args.steps} ["
    cmd = [sys.executable, "-m", "cli.main", "train", *(["--config", args.config] if args.config else []),
           "--output-dir", str(out / "run"), f"train.steps={args.steps}", "train.eval_every=0", *args.overrides]
    log_path = out / "relayrl.log"
    with open(log_path, "w") as log:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    root = psutil.Process(job.pid)
    cpu: dict[int, float] = {}
    names: dict[int, str] = {}
    marks: dict[str, tuple[float, dict[int, float]]] = {}
    spy_report: dict = {}
    spy_thread = None
    while job.poll() is None:
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            cpu[proc.pid] = times.user + times.system
            name = process_name(proc)
            if name and (proc.pid not in names or name != "IDLE"):  # an actor's process is IDLE before its class
                names[proc.pid] = name
        text = log_path.read_text(errors="replace")
        for marker in (BEGIN, end):
            if marker not in marks and marker in text:
                marks[marker] = (time.perf_counter(), dict(cpu))
        if args.spy_seconds and spy_thread is None and BEGIN in marks and time.perf_counter() > marks[BEGIN][0] + 5:
            pids = {names[p]: p for p in cpu if names.get(p) in SPIED} | {"driver": job.pid}
            spy_thread = threading.Thread(target=lambda: spy_report.update(spy(pids, args.spy_seconds, out)))
            spy_thread.start()
        time.sleep(0.25)
    if spy_thread is not None:
        spy_thread.join()
    if job.returncode != 0 or BEGIN not in marks or end not in marks:
        raise SystemExit(f"the job failed or its markers are missing (exit {job.returncode}); see {log_path}")
    (t0, before), (t1, after) = marks[BEGIN], marks[end]
    per_name: dict[str, float] = defaultdict(float)
    for pid, seconds in after.items():
        per_name[names.get(pid, "?")] += seconds - before.get(pid, 0.0)
    total = sum(per_name.values())
    summary = json.loads((out / "run" / "summary.json").read_text())
    result = {"steps": args.steps, "window_s": t1 - t0, "cpu_s": total, "cpu_s_per_step": total / args.steps,
              "train_s_per_step": summary["train_seconds"] / args.steps,
              "phase_s_per_step": {k: v / args.steps for k, v in summary["phase_seconds"].items()},
              "per_process_cpu_s_per_step": {k: v / args.steps
                                             for k, v in sorted(per_name.items(), key=lambda kv: -kv[1])},
              "load_average_end": os.getloadavg()[0], "overrides": args.overrides, "spy": spy_report}
    (out / "actor_cpu.json").write_text(json.dumps(result, indent=1))
    print(f"{args.steps} steps in {t1 - t0:.1f} s: {result['train_s_per_step']:.3f} s/step "
          f"({', '.join(f'{k} {v:.3f}' for k, v in result['phase_s_per_step'].items())}); "
          f"CPU {total / args.steps:.3f} s/step; load average at the end {result['load_average_end']:.1f}")
    for name, seconds in result["per_process_cpu_s_per_step"].items():
        print(f"  {name:24s} {seconds:.4f} CPU s/step  {100 * seconds * args.steps / total:5.1f}%")
    for name, rep in spy_report.items():
        print(f"py-spy {name}: busy {rep['busy_s']:.1f} s of {rep['window_s']} s")
        for seconds, func, where in rep["top"][:25]:
            print(f"  {seconds:6.2f} s  {func}  {where}")


if __name__ == "__main__":
    main()
