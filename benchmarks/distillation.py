"""On-policy distillation against RL from the same student start (issue 34, item 4), in one run.

The task is the addition demo's. The student is the shipped demo model (a 0.3M-parameter Qwen2 shape, warm-started
until about 45% held-out accuracy). The teacher is the same model trained longer (supervised until 90%); both are
built once and cached (demos/model_cache.py). Each mode is a `relayrl train` job as a user runs it, in its own process, one after the
other, with the same seed, steps and held-out evaluations every `--eval-every` steps:

    rl       the shipped `make train` job (DAPO: verifier reward only)
    distill  the teacher's per-token reverse-KL advantage only (algorithm.distillation.weight=1)
    mix      half of each (weight 0.5)
    distill_topk  the forward KL from the teacher's top 8 tokens at every position (of the demo's 15; weight 1,
             algorithm.distillation.top_k=8) in place of the sampled-token advantage
    mix_topk half of the top-k loss, half of the verifier's advantage (weight 0.5, top_k=8)
    distill_topk_64x2  distill_topk on 64 prompts x 2 samples a step instead of 16 x 8 (the same 128 samples:
             distillation needs no group baseline, so the positions may come from more prompts)
    distill_topk_64x2_lr2e-4  the same at learner.lr 2e-4: four times the step size, which the student needs to
             cover its distance to the teacher in 50 steps (docs/distillation.md)
    distill_topk_128x2_lr2e-4  128 prompts x 2 samples at lr 2e-4: twice the samples a step, for the larger
             step's gradient noise
    distill_full_128x2_cos  the forward KL from all 15 of the teacher's tokens (the full forward KL), 128 x 2,
             lr 2e-4 falling along a half cosine to 0 over the run (learner.lr_decay_steps = --steps): large steps
             early, small ones late to settle near the teacher instead of bouncing around it
    distill_full_256x1_cos  distill_full_128x2_cos on 256 prompts x 1 sample: the same samples a step, each from
             its own prompt
    distill_full_128x2_cos_t06  the same with the student sampling at temperature 0.6 (both models scored at
             0.6): positions nearer the student's greedy path, which the held-out evaluation follows

It prints and writes (`--out`: results.json, table.md, distillation.png) held-out accuracy against steps and
against training seconds, the steps and seconds each mode takes to reach the RL run's final accuracy, and the
teacher's own held-out accuracy measured by the same evaluation (the held-out accuracy before training of a
one-step job on the teacher).

The mid-run evaluations use the job's 200 held-out problems; one of them has a standard error of 2 to 3 points,
the size of the second goal's margin. So after the jobs, the teacher and every mode's final model are evaluated
greedily on the whole held-out split (`relayrl eval`, 1,021 problems for the demo's operands), and each mode's gap
to the teacher is the mean of the per-problem differences, with the standard error of that paired mean.

    python benchmarks/distillation.py --steps 200 --eval-every 10 --out runs/bench_distill [key=value ...]

Run it on an otherwise idle machine: the jobs run one after the other, so load that changes between them moves
the seconds (not the steps).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEACHER_SHAPE = {"warm_start_steps": 6000, "warm_start_target_accuracy": 0.9}
"""The teacher: the student's shape, supervised on until 90% greedy accuracy on problems of the training split it
never trained on (or 6,000 steps); the student stops at 45%. A larger teacher (hidden 256, 4 layers) learned about
ten times slower per step here and was still at 84-86% after 2,700 steps."""

MODES = {
    "rl": [],
    "distill": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1"],
    "mix": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=0.5"],
    "distill_topk": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1",
                     "algorithm.distillation.top_k=8"],
    "mix_topk": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=0.5",
                 "algorithm.distillation.top_k=8"],
    "distill_topk_64x2": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1",
                          "algorithm.distillation.top_k=8", "learner.prompts_per_step=64",
                          "rollout.samples_per_prompt=2"],
    "distill_topk_64x2_lr2e-4": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1",
                                 "algorithm.distillation.top_k=8", "learner.prompts_per_step=64",
                                 "rollout.samples_per_prompt=2", "learner.lr=2e-4"],
    "distill_topk_128x2_lr2e-4": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1",
                                  "algorithm.distillation.top_k=8", "learner.prompts_per_step=128",
                                  "rollout.samples_per_prompt=2", "rollout.prompts_in_flight=128",
                                  "learner.lr=2e-4"],
    # Issue 34's second goal (within 3 points of the teacher): run for 800 steps, the lr decay lets the student
    # take 2e-4 steps early and settle late; docs/distillation.md has what it reached (not the teacher's 0.920).
    "distill_full_128x2_cos": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1",
                               "algorithm.distillation.top_k=15", "learner.prompts_per_step=128",
                               "rollout.samples_per_prompt=2", "rollout.prompts_in_flight=128",
                               "learner.lr=2e-4", "learner.lr_decay_steps={steps}"],
    # Groups of one sample (pure distillation needs no group baseline): the same 256 samples a step as 128 x 2,
    # each from its own prompt.
    "distill_full_256x1_cos": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1",
                               "algorithm.distillation.top_k=15", "learner.prompts_per_step=256",
                               "rollout.samples_per_prompt=1", "rollout.prompts_in_flight=256",
                               "learner.lr=2e-4", "learner.lr_decay_steps={steps}"],
    # The student's samples nearer its greedy path, which the held-out evaluation follows (measured to step 150).
    "distill_full_128x2_cos_t06": ["algorithm.dynamic_sampling=false", "algorithm.distillation.weight=1",
                                   "algorithm.distillation.top_k=15", "learner.prompts_per_step=128",
                                   "rollout.samples_per_prompt=2", "rollout.prompts_in_flight=128",
                                   "learner.lr=2e-4", "learner.lr_decay_steps={steps}", "rollout.temperature=0.6"],
}
"""Overrides of each mode over the shipped demo job. Dynamic sampling is off when the teacher trains: a group whose
rewards are all equal still carries the teacher's per-token signal."""

DEFAULT_MODES = ("rl", "mix_topk", "distill_full_256x1_cos")
"""What `make train-distill` runs: RL, the mix and the best distillation, side by side (35 minutes on the loaded
2-core machine at the default 200 steps; docs/distillation.md)."""


def build_teacher() -> str:
    """The cached teacher folder (built on first use: a few minutes of supervised steps on 2 cores)."""
    from demos.arithmetic_model import prepare_demo_model
    from protocols.model import DemoModelConfig

    return prepare_demo_model(demo=DemoModelConfig(**TEACHER_SHAPE))


def run_job(name: str, out: Path, overrides: list[str], reuse: bool = False) -> dict:
    """One `relayrl train` job in its own process; returns its summary and metrics rows. `reuse`: read a finished
    job's folder instead of running it again."""
    folder = out / name
    if reuse and (folder / "summary.json").is_file():
        print(f"[{name}] reusing {folder}", flush=True)
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return {"summary": json.loads((folder / "summary.json").read_text()), "rows": rows}
    cmd = [sys.executable, "-m", "cli.main", "train", "--output-dir", str(folder), "logging.plots=false",
           *overrides]
    print(f"[{name}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True, env=os.environ.copy())
    print(f"[{name}] done in {time.perf_counter() - t0:.0f} s (log: {out / f'{name}.log'})", flush=True)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {"summary": json.loads((folder / "summary.json").read_text()), "rows": rows}


def curve(job: dict) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, held-out accuracy): before training, at each mid-run evaluation, after."""
    summary, rows = job["summary"], job["rows"]
    points, seconds = [(0, 0.0, summary["accuracy_before"])], 0.0
    for row in rows:
        seconds += row["time/step_s"]
        if "eval/accuracy" in row:
            points.append((int(row["step"]), seconds, row["eval/accuracy"]))
    if points[-1][0] != summary["steps"]:
        points.append((summary["steps"], seconds, summary["accuracy_after"]))
    return points


def whole_test_split(job_config: dict) -> int:
    """How many problems the held-out split holds for the job's operands (the final evaluation takes them all)."""
    from rewards.arithmetic_data import pair_split

    data = job_config["data"]
    operands = range(data["arithmetic_min_operand"], data["arithmetic_max_operand"] + 1)
    return sum(pair_split(a, b) == "test" for a in operands for b in operands)


def evaluate_final(name: str, out: Path, model: str, prompts: int, reuse: bool = False) -> dict[str, bool]:
    """Greedy correctness per held-out problem id of `model` on `prompts` problems, through `relayrl eval` with
    the job's own settings (its config.yaml). `reuse`: read an evaluation already in the job's folder."""
    folder = out / name / "eval_whole_split"
    if not (reuse and (folder / "generations.jsonl").is_file()):
        cmd = [sys.executable, "-m", "cli.main", "eval", "--model", model, "--data", "demo", "--samples", "0",
               "--num-prompts", str(prompts), "--config", str(out / name / "config.yaml"), "--output-dir",
               str(folder)]
        with open(out / f"{name}_eval.log", "w") as log:
            subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, check=True, env=os.environ.copy())
    rows = [json.loads(line) for line in (folder / "generations.jsonl").read_text().splitlines()]
    return {row["prompt_id"]: bool(row["correct"]) for row in rows}


def paired_gap(teacher: dict[str, bool], student: dict[str, bool]) -> tuple[float, float]:
    """(mean, standard error) of teacher minus student correctness over the problems both answered, in accuracy
    units. Paired: the two models answer the same problems, so the problems' own difficulty cancels."""
    diffs = [int(teacher[key]) - int(student[key]) for key in teacher.keys() & student.keys()]
    n = len(diffs)
    if n < 2:
        raise ValueError(f"paired_gap needs at least 2 problems answered by both models, got {n}")
    mean = sum(diffs) / n
    variance = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    return mean, (variance / n) ** 0.5


def first_reaching(points: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, seconds) of the first evaluation at or above `target`; None if none."""
    return next(((step, s) for step, s, acc in points if acc >= target - 1e-9), None)


def plot(curves: dict[str, list], teacher_accuracy: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in curves.items():
        steps, seconds, acc = zip(*points)
        axes[0].plot(steps, acc, marker="o", label=name)
        axes[1].plot(seconds, acc, marker="o", label=name)
    for ax, xlabel in zip(axes, ("learner step", "training seconds (2-core CPU)")):
        ax.axhline(teacher_accuracy, color="grey", linestyle="--", label="teacher")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("Addition demo: on-policy distillation vs RL from the same student")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def final_evaluation(out: Path, teacher: str, modes: list[str], reuse: bool, results: dict) -> list[str]:
    """The teacher and each mode's final model on the whole held-out split; the table's lines, and
    `results["whole_split"]`."""
    prompts = whole_test_split(yaml.safe_load((out / "teacher" / "config.yaml").read_text()))
    teacher_correct = evaluate_final("teacher", out, teacher, prompts, reuse)
    teacher_accuracy = sum(teacher_correct.values()) / len(teacher_correct)
    whole = results["whole_split"] = {"prompts": prompts, "teacher": teacher_accuracy, "modes": {}}
    lines = [f"\nThe whole held-out split ({prompts} problems, greedy): teacher {teacher_accuracy:.3f}",
             "| mode | after | gap to the teacher (points) | its standard error (paired) |", "| --- | --- | --- | --- |"]
    for mode in modes:
        correct = evaluate_final(mode, out, str(out / mode / "final_model"), prompts, reuse)
        gap, stderr = paired_gap(teacher_correct, correct)
        accuracy = sum(correct.values()) / len(correct)
        whole["modes"][mode] = {"accuracy": accuracy, "gap": gap, "gap_stderr": stderr}
        lines.append(f"| {mode} | {accuracy:.3f} | {100 * gap:.1f} | {100 * stderr:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default="runs/bench_distill")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                        help=f"comma-separated, of {', '.join(MODES)} (default: %(default)s)")
    parser.add_argument("--reuse", action="store_true", help="read jobs already finished in --out")
    parser.add_argument("--no-final-eval", action="store_true",
                        help="skip the greedy evaluation of the teacher and every final model on the whole held-out split")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every job")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    teacher = build_teacher()
    print(f"teacher folder {teacher} ready after {time.perf_counter() - t0:.0f} s", flush=True)
    teacher_job = run_job("teacher", out, [f"model.path={teacher}", "train.steps=1", *args.overrides], args.reuse)
    teacher_accuracy = teacher_job["summary"]["accuracy_before"]
    common = [f"train.steps={args.steps}", f"train.eval_every={args.eval_every}", *args.overrides]
    jobs = {}
    for mode in args.modes.split(","):
        with_teacher = [f"teacher.path={teacher}", "teacher.num_workers=1"] if mode != "rl" else []
        overrides = [item.format(steps=args.steps) for item in MODES[mode]]  # {steps}: the run's train.steps
        jobs[mode] = run_job(mode, out, [*common, *with_teacher, *overrides], args.reuse)
    curves = {mode: curve(job) for mode, job in jobs.items()}
    rl_final = curves["rl"][-1][2] if "rl" in curves else None
    results = {"teacher_accuracy": teacher_accuracy, "teacher_shape": TEACHER_SHAPE, "steps": args.steps,
               "curves": curves, "rl_final_accuracy": rl_final, "modes": {}}
    lines = ["| mode | held-out before | after | training s | steps to RL's final | seconds to RL's final |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mode, points in curves.items():
        reach = first_reaching(points, rl_final) if rl_final is not None else None
        results["modes"][mode] = {"before": points[0][2], "after": points[-1][2], "train_s": points[-1][1],
                                  "reach_rl_final": reach,
                                  "teacher_kl_last": jobs[mode]["rows"][-1].get("teacher/reverse_kl_mean"),
                                  "topk_kl_last": jobs[mode]["rows"][-1].get("teacher/topk_kl"),
                                  "topk_mass_last": jobs[mode]["rows"][-1].get("teacher/topk_mass")}
        lines.append(f"| {mode} | {points[0][2]:.3f} | {points[-1][2]:.3f} | {points[-1][1]:.1f} | "
                     f"{reach[0] if reach else '-'} | {f'{reach[1]:.1f}' if reach else '-'} |")
    lines.append(f"\nTeacher held-out accuracy: {teacher_accuracy:.3f}")
    if not args.no_final_eval:
        lines += final_evaluation(out, teacher, list(jobs), args.reuse, results)
    table = "\n".join(lines)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(curves, teacher_accuracy, out / "distillation.png")
    print(f"wrote {out / 'table.md'}, {out / 'results.json'}, {out / 'distillation.png'}")


if __name__ == "__main__":
    main()
