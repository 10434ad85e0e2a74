"""A killed rollout worker under weight_sync.type=collective: the broadcast group has a fixed membership, so the
rollout pool replaces the worker and every engine and learner rank 0 open a new group (cluster/rollout_pool.py). The
run must finish with every group accounted for, and each replacement must receive later versions through its new
group: at the end it holds the learner's newest weights, to the log-prob."""

import json
import os
import time

import pytest
import ray
import torch

from cluster.scale_requests import request_scale
from tests.test_worker_failure import check_finished_and_accounted

pytestmark = pytest.mark.slow


def exited(pid: int) -> bool:
    """The process is gone or a zombie: either way the kernel has closed its sockets."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def kill_and_wait(worker, pid: int) -> None:
    """Kill `worker` (a process on this machine) and return once its process has exited and the learner's gloo
    connections to it have had time to read the close."""
    ray.kill(worker)
    deadline = time.monotonic() + 60
    while not exited(pid):
        assert time.monotonic() < deadline, "the killed rollout worker's process is still running"
        time.sleep(0.05)
    time.sleep(1.0)


def test_killed_rollout_workers_rejoin_the_collective_weight_group(ray_cluster, tmp_path):
    """One run, two kills at the two moments that take different paths (one run instead of one per moment: a
    Trainer's start costs most of a test's time here). Worker 0 is killed between the learner's 5th update and its
    broadcast, which then meets the dead engine before any health check can (the supervisor replaces it and sends
    the version again, on the new group). The weight-sync check (on by default) proves every engine holds the
    weights its version label says. Worker 1 is killed once version 8 is announced (the driver waits meanwhile), so the
    driver's next health check finds it first; its replacement opens the second new group, which the first
    replacement joins as a survivor. After step 10 `relayrl scale` shrinks the pool to 1: slot 1 drains beside the
    steps, then the one engine left opens a third group, on which versions 11 and 12 reach it."""
    from cluster.trainer import Trainer
    from protocols.training_batch import TrainingBatch
    from tests.test_pipeline import demo_config

    # bucket_mb=1: the demo model (about 1.7 MB of fp32) goes in two buckets per broadcast
    cfg = demo_config(tmp_path, "train.steps=12", "train.max_staleness=1", "rollout.num_workers=2",
                      "reward.num_workers=2", "rollout.prompts_in_flight=8", "data.num_eval_prompts=20",
                      "weight_sync.type=collective", "weight_sync.bucket_mb=1", "weight_sync.timeout_s=60")
    trainer = Trainer(cfg)
    killed: list[str] = []
    pids = ray.get([w.__ray_call__.remote(lambda _: os.getpid()) for w in trainer.rollout_workers])
    train_step, step = trainer.learner.train_step, trainer.step

    def train_then_kill(*args):
        metrics = train_step(*args)
        if trainer.version == 4 and not killed:  # the update whose weights go out as version 5
            kill_and_wait(trainer.rollout_workers[0], pids[0])
            killed.append("before_a_publish")
        return metrics

    def step_then_kill(groups):
        metrics = step(groups)
        if trainer.version == 8 and killed == ["before_a_publish"]:
            # version 8 is announced: the workers start loading it and generating with it
            kill_and_wait(trainer.rollout_workers[1], pids[1])
            killed.append("after_a_publish")
        if trainer.version == 10:
            assert request_scale(tmp_path, 1) == 1
        return metrics

    trainer.learner.train_step = train_then_kill
    trainer.step = step_then_kill
    try:
        summary = trainer.run()
        trained = list(trainer.trained_group_ids)
        resent = trainer.supervisor.resent_publishes
        # After the run every engine was brought to the last published version (both replacements) through the
        # rejoined group: their log-probs must be the learner's, as in test_weight_sync.
        probe = {"prompt_ids": [[1, 3, 13, 4, 14], [1, 5, 13, 9, 14]], "response_ids": [[5, 7, 2], [3, 3, 8, 2]]}
        versions = ray.get([w.get_version.remote() for w in trainer.rollout_workers])
        worker_stats = ray.get(trainer.controller.get_worker_stats.remote())
        engines = ray.get([w.sequence_logprobs.remote(probe["prompt_ids"], probe["response_ids"])
                           for w in trainer.rollout_workers])
        batch = TrainingBatch.from_samples(probe["prompt_ids"], probe["response_ids"])
        learner = batch.per_sample_rows(trainer.learner.policy_logprobs(batch))
    finally:
        trainer.shutdown()
    assert killed == ["before_a_publish", "after_a_publish"], f"the run ended before both kills: {killed}"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # every admitted group trained, dropped with a reason or queued (the release of a dead worker's leases is
    # test_worker_failure's check: here its leases may end before the kill lands, demo groups take a fraction of a
    # second)
    check_finished_and_accounted(tmp_path, summary, trained, rows)
    assert summary["replaced_workers"] == {"rollout": 2, "reward": 0, "reference": 0, "teacher": 0,
                                           "critic": 0}
    # before_a_publish: the broadcast of version 5 failed and went out again on the new group; after_a_publish:
    # the health check found the dead worker before any broadcast did, so nothing was sent twice
    assert resent == 1
    # each replacement's first load came through its new group, labelled with the weights it is: 5, the version
    # whose broadcast broke (the learner had already stepped to it; slot 0's replacement, id 2, which stays), and
    # 8, the one announced when it joined (slot 1's replacement, id 3, which later drained out: its probes)
    assert any(r["versions_seen"][:2] == [0, 5] for r in summary["rollout"]), summary["rollout"]
    assert min(p["version"] for p in worker_stats[3]["weight_probes"]) == 8, worker_stats[3]["weight_probes"]
    done = json.loads((tmp_path / "control" / "scale_done.json").read_text())
    assert (done["id"], done["rollout"]) == (1, 1) and "error" not in done, done
    # the one engine left holds the last version, received on the group it opened after the drain
    assert versions == [summary["steps"]] == [12]
    flat = lambda rows: torch.tensor([x for row in rows for x in row])  # noqa: E731
    gaps = [float((flat(engine) - flat(learner)).abs().max()) for engine in engines]
    print(f"broadcasts resent {resent}, replacements' log-prob gaps {gaps}, wall {summary['wall_seconds']:.0f} s")
    assert max(gaps) < 1e-4, f"the replacements' engines are {gaps} away from the learner's newest weights"


@ray.remote(num_cpus=0)
class StopResume:
    """The controller's stop/resume stand-in."""

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def resume(self) -> None:
        self.stopped = False

    def is_stopped(self) -> bool:
        return self.stopped


@ray.remote(num_cpus=0)
class Looping:
    """A rollout worker's run() stand-in: it returns when the controller stops, or never if the actor dies."""

    def __init__(self, controller) -> None:
        self.controller = controller

    def run(self) -> dict:
        while not ray.get(self.controller.is_stopped.remote()):
            time.sleep(0.05)
        return {}


@pytest.mark.slow
def test_two_engines_dead_at_once_are_each_replaced_once(ray_cluster):
    """Under weight_sync.type=collective the first replacement stops every run to rebuild the weight group;
    stopping meets the second dead worker and replaces it there, so the health check that found both must not
    replace it again (nor look up its old run ref among the new ones)."""
    from cluster.rollout_pool import RolloutPool
    from cluster.worker_pool import PoolContext
    from protocols.config import load_config

    cfg = load_config(None, ["rollout.num_workers=3"])
    controller = StopResume.remote()
    workers = [Looping.remote(controller) for _ in range(3)]
    pool = RolloutPool(PoolContext(cfg, controller, placement=None, model_path="unused"))
    pool.workers.extend(workers)
    pool.start_runs()
    replaced: list[int] = []

    def replace(index: int, err: BaseException) -> None:
        # RolloutPool.replace's collective path with the engine start and the weight group left out: a new actor
        # in the slot, then every run stopped (which replaces any other dead one) and started again
        replaced.append(index)
        pool.workers[index] = Looping.remote(controller)
        if pool.run_refs is not None:
            pool.run_refs[index] = None
            pool.stop_runs()
            ray.get(controller.resume.remote())
            pool.start_runs()

    pool.replace = replace
    ray.kill(workers[0])
    ray.kill(workers[2])
    ray.wait([pool.run_refs[0], pool.run_refs[2]], num_returns=2, timeout=60)
    pool.check()
    assert sorted(replaced) == [0, 2]
    assert workers[1] in pool.workers and len(set(map(id, pool.workers))) == 3
    pool.check()  # the new runs are alive: nothing more to replace
    assert sorted(replaced) == [0, 2]
    for worker in pool.workers:
        ray.kill(worker)


@ray.remote(num_cpus=0)
class EngineThatFails:
    """A new rollout worker whose engine start raised."""

    def get_version(self) -> int:
        raise RuntimeError("engine start failed")


@ray.remote(num_cpus=0)
class RetiredIds:
    """The controller's retire_worker stand-in."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def retire_worker(self, worker_id: int) -> None:
        self.ids.append(worker_id)

    def retired(self) -> list[int]:
        return self.ids


@pytest.mark.slow
def test_a_grow_whose_engine_fails_to_start_is_counted_and_the_pool_keeps_its_size(ray_cluster):
    """begin_grow returns at once; finish_grow finds the new engine's start failed: the actor is killed, its
    reserved id retired, the failure counted, and WorkerLost says so; the pool keeps the worker it had."""
    from cluster.rollout_pool import RolloutPool
    from cluster.worker_pool import PoolContext, WorkerLost
    from protocols.config import load_config

    controller = RetiredIds.remote()
    pool = RolloutPool(PoolContext(load_config(None, []), controller, placement=None, model_path="unused"))
    launched = StopResume.remote()  # slot 0's worker (any live actor: the grow does not call it)
    pool.workers.append(launched)
    pool.build = lambda slot, worker_id: EngineThatFails.remote()
    pool.begin_grow(2)
    assert pool.joining is not None and pool.workers == [launched]
    with pytest.raises(WorkerLost, match=r"1 of 1 new rollout worker\(s\) did not start \(its start failed: .*"
                                         r"engine start failed\); the pool goes on with 1"):
        pool.finish_grow(wait=True)
    assert pool.joining is None and pool.workers == [launched] and pool.ids.ids == [0]
    assert pool.start_failures == 1 and ray.get(controller.retired.remote()) == [1]
    assert pool.finish_grow() is None  # nothing under way
    ray.kill(launched)


@ray.remote(num_cpus=0)
class JoinController:
    """The controller's stand-in for a grow: ids retired and released, the pool's size, the newest weights, stop."""

    def __init__(self) -> None:
        self.calls: list = []
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True

    def is_stopped(self) -> bool:
        return self.stopped

    def retire_worker(self, worker_id: int) -> None:
        self.calls.append(("retire", worker_id))

    def release_worker(self, worker_id: int, reason: str) -> list[str]:
        self.calls.append(("release", worker_id, reason))
        return []

    def set_num_workers(self, n: int) -> None:
        self.calls.append(("size", n))

    def latest_weights(self, known_version: int) -> int:
        return 3  # an announcement stand-in: the engines only pass it on

    def seen(self) -> list:
        return self.calls


@ray.remote(num_cpus=0, max_restarts=0)
class EngineThatDiesJoining:
    """A new engine that serves its probe, then dies at its first weight load or its first run."""

    def __init__(self, controller) -> None:
        pass

    def get_version(self) -> int:
        return 0

    def load_weights(self, announcement) -> float:
        os._exit(1)

    def run(self) -> dict:
        os._exit(1)


@ray.remote(num_cpus=0)
class Engine:
    """A rollout worker stand-in that starts, loads and runs until the controller stops."""

    def __init__(self, controller) -> None:
        self.controller = controller
        self.loaded: list = []

    def run(self) -> dict:
        while not ray.get(self.controller.is_stopped.remote()):
            time.sleep(0.05)
        return {}

    def get_version(self) -> int:
        return 0

    def load_weights(self, announcement) -> float:
        self.loaded.append(announcement)
        return 0.0

    def loads(self) -> list:
        return self.loaded


@ray.remote(num_cpus=0)
class EngineWhoseFirstLoadRaises(Engine.__ray_actor_class__):
    """A new engine that stays alive but whose first weight load raises (its run loads again at its first sync)."""

    def load_weights(self, announcement) -> float:
        raise OSError("no space left on device")


@pytest.mark.slow
def test_a_first_load_that_raises_without_the_engine_dying_is_counted_and_the_engine_serves(ray_cluster):
    from cluster.rollout_pool import RolloutPool
    from cluster.worker_pool import PoolContext
    from protocols.config import load_config

    controller = JoinController.remote()
    pool = RolloutPool(PoolContext(load_config(None, []), controller, placement=None, model_path="unused"))
    pool.workers.append(Engine.remote(controller))
    pool.build = lambda slot, worker_id: EngineWhoseFirstLoadRaises.remote(controller)
    pool.start_runs()
    pool.begin_grow(2)
    assert pool.finish_grow(wait=True) is not None
    (load,) = pool.first_loads
    ray.wait([load], timeout=60)
    pool.check()
    assert pool.first_load_failures == 1 and pool.first_loads == {} and pool.replaced == 0
    assert ray.wait([pool.run_refs[1]], timeout=0)[1]  # still running: nothing to replace
    ray.get(controller.stop.remote())
    assert len(pool.stop_runs()) == 2
    for worker in pool.workers:
        ray.kill(worker)


@pytest.mark.slow
@pytest.mark.parametrize("generating", [True, False], ids=["while generating", "idle"])
def test_an_engine_that_dies_at_its_join_is_replaced_and_the_pool_reaches_its_size(ray_cluster, generating):
    """An engine that started (it answered its probe) and died at its first weight load, before it served: sent
    with its run, unwaited, while generation runs (the engine's run ends with it), or waited for on an idle pool.
    Either way it is replaced as a dead worker is (its id released, a new one started), and the grow ends with
    the size asked for."""
    from cluster.rollout_pool import RolloutPool
    from cluster.worker_pool import PoolContext
    from protocols.config import load_config

    controller = JoinController.remote()
    pool = RolloutPool(PoolContext(load_config(None, []), controller, placement=None, model_path="unused"))
    pool.workers.append(Engine.remote(controller))
    built = iter([EngineThatDiesJoining, Engine])
    pool.build = lambda slot, worker_id: next(built).remote(controller)
    if generating:
        pool.start_runs()
    pool.begin_grow(2)
    assert pool.finish_grow(wait=True) is not None  # it served its probe: it joined
    if generating:
        ray.wait([pool.run_refs[1]], timeout=60)  # its first run ended with the actor
        pool.check()
    assert pool.replaced == 1 and len(pool.workers) == 2 and pool.ids.ids == [0, 2]
    assert ("release", 1, "rollout_worker_died") in ray.get(controller.seen.remote())
    if generating:
        pool.check()  # the replacement runs: nothing more to replace
        assert pool.replaced == 1
        ray.get(controller.stop.remote())
        assert len(pool.stop_runs()) == 2
    else:
        assert ray.get(pool.workers[1].loads.remote()) == [3]  # the replacement loaded the newest weights
    for worker in pool.workers:
        ray.kill(worker)
