"""The data plane's cost on the control plane (issue 47): synthetic groups pushed through the real controller actor,
its scoring (reward workers with the run's verifier), and the driver's read of each batch, on a local Ray cluster,
at 1k, 8k and 32k tokens per sample. Measures the controller's CPU seconds per group, its peak memory (RSS), the
groups per second one controller could take (1 / its CPU seconds per group) and the groups per second that reached
the driver, end to end.

A producer actor stands in for the rollout worker (the tokens are random, the response text fixed, so the
verifier's work does not grow with tokens) and hands groups over as the code under test does: on today's code
(`actors/scoring_stage.py`) it keeps them in its outbox and hands over headers; on the code before it (no
scoring stage) it sends each group to a reward worker through its ScoreRouter and hands over the scored refs.

    python benchmarks/data_plane.py --compare /path/to/old/checkout   # both, in one invocation, with ratios
    python benchmarks/data_plane.py --json                              # this checkout only

`--compare` runs this file twice, once with the old checkout first on PYTHONPATH (its own modules, its own Ray
workers), then with this one, and prints both and their ratios.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE = (Path(importlib.util.find_spec("actors").origin).parent / "scoring_stage.py").exists()
"""The code under test has the controller's scoring stage (headers and refs); else the rollout worker's router."""


def make_group(group_id: str, prompt, tokens: int, samples: int, seed: int):
    from protocols.trajectory import Trajectory, TrajectoryGroup

    rng = random.Random(seed)
    return TrajectoryGroup(group_id=group_id, trajectories=[
        Trajectory(group_id=group_id, sample_index=i, prompt=prompt,
                   response_token_ids=[rng.randrange(1000) for _ in range(tokens)],
                   behavior_logprobs=[-rng.random() for _ in range(tokens)], token_versions=[0] * tokens,
                   finish_reason="length", response_text=f"the answer is {i}")
        for i in range(samples)])


class Producer:
    """The rollout worker's side of the hand-over, without an engine."""

    def __init__(self, controller, reward_workers: list, tokens: int, samples: int) -> None:
        self.controller, self.tokens, self.samples = controller, tokens, samples
        self.outbox: dict = {}
        self.router = None
        if not STAGE:
            from actors.score_router import ScoreRouter

            self.router = ScoreRouter(reward_workers, {}, [], 2, 600.0)

    def take_groups(self, group_ids: list[str]):
        groups = tuple(self.outbox.pop(g) for g in group_ids)
        return groups[0] if len(groups) == 1 else groups

    def run(self, num_groups: int, per_call: int) -> float:
        """Hand over `num_groups` groups, `per_call` per `sync`; returns the seconds spent making groups."""
        import ray

        from actors.controller_messages import SyncRequest

        made, handed, scored, make_s = 0, 0, [], 0.0
        me = ray.get_runtime_context().current_actor
        while handed < num_groups:
            want = min(per_call, num_groups - made)
            request = SyncRequest(worker_id=0, version=0, want=want, in_flight=made - handed, scored=scored)
            if STAGE:
                request.outbox = me
            handed += len(scored)
            reply = ray.get(self.controller.sync.remote(request))
            scored = []
            t0 = time.perf_counter()
            groups = [make_group(g, p, self.tokens, self.samples, made + i) for i, (g, p) in enumerate(reply.granted)]
            make_s += time.perf_counter() - t0
            made += len(groups)
            if STAGE:
                from protocols.group_header import GroupHeader

                for group in groups:
                    self.outbox[group.group_id] = group
                    scored.append((group.group_id, dataclasses.replace(GroupHeader.of(group), group=None)))
            else:
                for group in groups:
                    self.router.send(group)
                while self.router.scoring and (handed + len(scored) < made):
                    scored += self.router.collect()
                    time.sleep(0.001)
        return make_s


def _rss_peak(pid: int, stop: threading.Event, out: list) -> None:
    import psutil

    proc, peak = psutil.Process(pid), 0
    while not stop.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.01)
    out.append(peak)


def measure(tokens: int, num_groups: int, samples: int, reward_workers: int, per_step: int) -> dict:
    import psutil
    import ray

    from actors.controller import ControllerActor
    from actors.reward_worker import RewardWorker
    from protocols.config import load_config
    from protocols.trajectory import Prompt

    cfg = load_config(None, [])
    prompts = [Prompt(prompt_id=f"p{i}", prompt_token_ids=[1, 2, 3], answer="1") for i in range(64)]
    controller = ray.remote(ControllerActor).options(num_cpus=0, max_concurrency=100).remote(
        prompts, per_step, 10_000, False, 0, 1)
    workers = [ray.remote(RewardWorker).options(num_cpus=0).remote(cfg.reward, i) for i in range(reward_workers)]
    ray.get([w.ping.remote() for w in workers])
    if STAGE:
        ray.get(controller.set_scoring_workers.remote({"reward": workers}))
        from actors.rollout_worker import OUTBOX

        producer_cls = ray.remote(**OUTBOX)(Producer)
    else:
        producer_cls = ray.remote(Producer)
    producer = producer_cls.options(num_cpus=0).remote(controller, workers, tokens, samples)
    pid = ray.get(controller.__ray_call__.remote(lambda self: os.getpid()))
    proc = psutil.Process(pid)
    stop, peak = threading.Event(), []
    sampler = threading.Thread(target=_rss_peak, args=(pid, stop, peak), daemon=True)
    rss_before = proc.memory_info().rss
    sampler.start()
    cpu0 = sum(proc.cpu_times()[:2])
    start = time.perf_counter()
    made = producer.run.remote(num_groups, per_step)
    taken, fetch_s = 0, 0.0
    while taken < num_groups:
        batch = ray.get(controller.wait_batch.remote(0, 5.0))
        if batch is None:
            continue
        t0 = time.perf_counter()
        if STAGE:
            from cluster.group_fetch import fetch_groups

            groups, lost = fetch_groups(batch, 600.0)
            assert not lost
        else:
            groups = batch
        assert all(len(g.trajectories[0].response_token_ids) == tokens for g in groups)
        fetch_s += time.perf_counter() - t0
        taken += len(groups)
    wall = time.perf_counter() - start
    cpu = sum(proc.cpu_times()[:2]) - cpu0
    stop.set()
    sampler.join()
    make_s = ray.get(made)
    for actor in [controller, producer, *workers]:
        ray.kill(actor)
    return {"tokens": tokens, "groups": num_groups, "controller_cpu_s_per_group": cpu / num_groups,
            "controller_peak_rss_mb": peak[0] / 2**20, "controller_rss_growth_mb": (peak[0] - rss_before) / 2**20,
            "capacity_groups_per_s": num_groups / max(cpu, 1e-9),
            "delivered_groups_per_s": num_groups / max(wall - make_s, 1e-9), "driver_fetch_s": fetch_s}


def run_here(args) -> list[dict]:
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        measure(1024, 8, args.samples, args.reward_workers, args.per_step)  # warm-up: imports, worker processes
        return [measure(tokens, n, args.samples, args.reward_workers, args.per_step)
                for tokens, n in zip(args.tokens, args.groups)]
    finally:
        ray.shutdown()


def run_in(checkout: Path, args) -> list[dict]:
    """This file, run with `checkout`'s modules first on the path; its --json rows."""
    env = {**os.environ, "PYTHONPATH": f"{checkout}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--tokens", *map(str, args.tokens),
           "--groups", *map(str, args.groups), "--samples", str(args.samples),
           "--reward-workers", str(args.reward_workers), "--per-step", str(args.per_step)]
    out = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"the benchmark failed in {checkout}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


COLUMNS = ["controller_cpu_s_per_group", "controller_peak_rss_mb", "controller_rss_growth_mb", "capacity_groups_per_s",
           "delivered_groups_per_s"]


def table(name: str, rows: list[dict]) -> None:
    print(f"\n{name}\n| tokens/sample | groups | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for r in rows:
        print(f"| {r['tokens']} | {r['groups']} | " + " | ".join(f"{r[c]:.4g}" for c in COLUMNS) + " |")
    first, last = rows[0], rows[-1]
    print(f"{last['tokens']} vs {first['tokens']} tokens: CPU per group x"
          f"{last['controller_cpu_s_per_group'] / first['controller_cpu_s_per_group']:.2f}, peak RSS x"
          f"{last['controller_peak_rss_mb'] / first['controller_peak_rss_mb']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, help="an older checkout to measure first, in the same invocation")
    parser.add_argument("--json", action="store_true", help="print this checkout's rows as one JSON line")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--groups", type=int, nargs="+", default=[64, 48, 16])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--reward-workers", type=int, default=2)
    parser.add_argument("--per-step", type=int, default=8)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(run_here(args)))
        return
    print(f"{args.samples} samples per group, {args.reward_workers} reward workers, {args.per_step} groups per "
          f"sync and per batch; {os.cpu_count()} CPUs")
    before = run_in(args.compare.resolve(), args) if args.compare else None
    after = run_in(REPO, args)
    if before:
        table(f"before: {args.compare}", before)
    table(f"after: {REPO}", after)
    if before:
        print("\n| tokens/sample | CPU per group before/after | peak RSS before/after | capacity after/before "
              "| delivered after/before |\n|---|---|---|---|---|")
        for b, a in zip(before, after):
            print(f"| {a['tokens']} | {b['controller_cpu_s_per_group'] / a['controller_cpu_s_per_group']:.1f} "
                  f"| {b['controller_peak_rss_mb'] / a['controller_peak_rss_mb']:.2f} "
                  f"| {a['capacity_groups_per_s'] / b['capacity_groups_per_s']:.1f} "
                  f"| {a['delivered_groups_per_s'] / b['delivered_groups_per_s']:.2f} |")


if __name__ == "__main__":
    main()
