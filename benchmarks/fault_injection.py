"""Fault injection: the demo job run once per fault, each injected at a seeded random step.

Trials: `rollout` (one of two rollout workers killed with ray.kill), `reward` (one of two reward workers killed),
`driver` (the driver process killed, then `relayrl train --resume`; see `trial_driver_resume`), `reference` (the
one reference worker of a `grpo` run killed), `critic` (rank 0 of a two-rank critic group of a `ppo` run killed).
For each trial it prints whether the run completed, admitted = trained + dropped (by reason) + queued, the groups
re-scored, the groups trained twice (must be 0), the held-out accuracy after and the seconds from the kill to the
replacement counted.
    python benchmarks/fault_injection.py --steps 40 --seed 0 [--trials rollout,reward] [overrides...]
"""

import argparse
import json
import random
import tempfile
import threading
import time
import traceback
from pathlib import Path

import ray

from cli.driver_session import kill_session, launch_train
from cluster.trainer import Trainer
from protocols.config import load_config

COMMON = ["rollout.num_workers=2", "reward.num_workers=2", "train.max_staleness=1", "learner.prompts_per_step=8",
          "rollout.samples_per_prompt=8", "rollout.prompts_in_flight=8", "data.num_eval_prompts=100"]


ROLE_SETTINGS = {
    "rollout": [], "reward": [],
    # the reference and critic groups run only with the presets that use them; a `ppo` run here keeps one rollout
    # worker so the two critic ranks fit beside the learner on a 2-core machine
    "reference": ["algorithm.preset=grpo", "reference.num_workers=1"],
    "critic": ["algorithm.preset=ppo", "critic.num_workers=2", "rollout.num_workers=1"],
}
"""Settings each worker trial adds to COMMON (later settings win)."""


def kill_at_step(trainer: Trainer, role: str, index: int, step: int, done: threading.Event,
                 seen: dict) -> threading.Thread:
    """A thread that kills `role` worker `index` once the learner has trained `step` batches, then records in
    `seen["restart_s"]` the seconds until the supervisor counted its replacement."""
    per_step = trainer.cfg.learner.prompts_per_step

    def run() -> None:
        while ray.get(trainer.controller.stats.remote())["queue/trained"] < step * per_step:
            time.sleep(0.2)
        ray.kill(trainer.supervisor.workers(role)[index])
        start = time.monotonic()
        done.set()
        while not trainer.supervisor.replaced[role] and time.monotonic() - start < 600:
            time.sleep(0.05)
        seen["restart_s"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def trial_worker_kill(role: str, steps: int, kill_step: int, overrides: list[str]) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"relayrl_fault_{role}_"))
    cfg = load_config(None, [f"output_dir={out}", f"train.steps={steps}", *COMMON, *ROLE_SETTINGS[role],
                             *overrides])
    trainer = Trainer(cfg)
    killed, seen = threading.Event(), {}
    kill_at_step(trainer, role, 0, kill_step, killed, seen)
    start = time.perf_counter()
    try:
        summary = trainer.run()
        trained = list(trainer.trained_group_ids)
        completed, error = True, ""
    except Exception as err:  # the trial reports the failure instead of stopping the benchmark
        summary, trained, completed, error = {}, list(trainer.trained_group_ids), False, repr(err)
        traceback.print_exc()
    finally:
        trainer.shutdown()
    queue = summary.get("queue", {})
    return {
        "trial": f"kill {role} worker 0", "kill_step": kill_step, "killed": killed.is_set(),
        "completed": completed and (out / "summary.json").is_file() and (out / "final_model").is_dir(),
        "error": error, "queue": queue, "trained_ids": trained,
        "accuracy_before": summary.get("accuracy_before"), "accuracy_after": summary.get("accuracy_after"),
        "replaced": summary.get("replaced_workers", {}), "restart_s": seen.get("restart_s"),
        "wall_s": time.perf_counter() - start,
    }


def trial_driver_resume(steps: int, kill_step: int, overrides: list[str]) -> dict:
    """`relayrl train` in its own session with a checkpoint every step; SIGKILL the whole session (driver, Ray,
    every actor) once `kill_step` steps are logged; `relayrl train --resume RUN_DIR` to the end. The steps logged
    after the last checkpoint are trained again from the restored state, so the final history (summary.json's
    trained_group_ids) must still hold every group once."""
    out = Path(tempfile.mkdtemp(prefix="relayrl_fault_driver_"))
    settings = [f"output_dir={out}", f"train.steps={steps}", "train.save_every=1", *COMMON, *overrides]
    start = time.perf_counter()
    first = launch_train(settings, out / "first.log")
    while first.poll() is None and len(logged_steps(out)) < kill_step:
        time.sleep(0.5)
    killed = first.poll() is None
    kill_session(first)
    second = launch_train(["--resume", str(out)], out / "second.log")
    completed = second.wait() == 0
    kill_session(second)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    return {
        "trial": "kill the driver, then --resume", "kill_step": kill_step, "killed": killed,
        "completed": completed and bool(summary) and (out / "final_model").is_dir(),
        "error": "" if completed else (out / "second.log").read_text()[-2000:],
        "queue": summary.get("queue", {}), "trained_ids": summary.get("trained_group_ids", []),
        "accuracy_before": summary.get("accuracy_before"), "accuracy_after": summary.get("accuracy_after"),
        "replaced": {k: summary.get("resume", {}).get(k) for k in ("policy_version", "reissued_groups")},
        "wall_s": time.perf_counter() - start,
    }


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def report(result: dict) -> None:
    """One trial's lines: completed, the accounting identity with drops by reason, groups trained twice."""
    q = result["queue"]
    print(f"\n== {result['trial']} at step {result['kill_step']} (killed: {result['killed']}) ==")
    print(f"completed: {result['completed']}  {result['error']}")
    if q:
        dropped = {k.removeprefix("queue/dropped_"): v for k, v in q.items() if k.startswith("queue/dropped_")}
        total = q["queue/trained"] + sum(dropped.values()) + q["queue/depth"]
        print(f"admitted {q['queue/admitted']} = trained {q['queue/trained']} + dropped {sum(dropped.values())} "
              f"{dropped} + queued {q['queue/depth']} -> {'holds' if total == q['queue/admitted'] else 'BROKEN'}")
        rescored = {k.removeprefix("queue/rescored_"): v for k, v in q.items() if k.startswith("queue/rescored_")}
        print(f"re-scored after a worker died: {rescored}")
    ids = result["trained_ids"]
    print(f"groups trained twice: {len(ids) - len(set(ids))} (of {len(ids)} trained)")
    print(f"held-out accuracy: {result['accuracy_before']} -> {result['accuracy_after']}; "
          f"replaced workers / resume: {result['replaced']}; wall {result['wall_s']:.0f} s")
    if result.get("restart_s") is not None:
        print(f"kill -> replacement counted: {result['restart_s']:.1f} s")


TRIALS = {
    "rollout": lambda steps, at, extra: trial_worker_kill("rollout", steps, at, extra),
    "reward": lambda steps, at, extra: trial_worker_kill("reward", steps, at, extra),
    "driver": trial_driver_resume,
    "reference": lambda steps, at, extra: trial_worker_kill("reference", steps, at, extra),
    "critic": lambda steps, at, extra: trial_worker_kill("critic", steps, at, extra),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trials", default="rollout,reward,driver,reference,critic")
    args, extra = parser.parse_known_args()
    rng = random.Random(args.seed)
    for name in args.trials.split(","):
        # the fault lands between the first step and three steps before the end, so the run has work after it
        at = rng.randint(1, max(1, args.steps - 3))
        report(TRIALS[name](args.steps, at, extra))


if __name__ == "__main__":
    main()
