"""The demo job across a real multi-node Ray cluster on this machine: learner on one node, rollout on another.

Each node is its own raylet with its own object store (ray.cluster_utils.Cluster), so published weights reach
the rollout worker only by crossing object stores, as between machines. The session's local Ray is shut down for
this module (which runs last, tests/conftest.py); a later test that asks for `ray_cluster` starts it again.
"""

import json
import os
import shutil
import tempfile
import time

import pytest
import ray

from cluster.trainer import Trainer
from protocols.config import load_config
from tests.conftest import TEST_ENV_VARS

pytestmark = pytest.mark.slow

OBJECT_STORE_BYTES = 300 * 1024**2


@pytest.fixture(scope="module")
def three_nodes():
    """Head (driver, controller, reward workers), a learner node and a rollout node, each with its own raylet."""
    from ray.cluster_utils import Cluster

    from cluster.ray_setup import QUIET_ENV

    ray.shutdown()
    # A private temp dir: Cluster writes its address to <temp>/ray/ray_current_cluster, which a plain
    # ray.init() anywhere on this machine would otherwise join.
    old_tmp = os.environ.get("RAY_TMPDIR")
    tmp = tempfile.mkdtemp(prefix="rrmn", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 3, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
    # Logical GPUs (nothing uses them on CPU runs) let test_gpu_placement_groups reserve the GPU shapes for real.
    learner = cluster.add_node(num_cpus=2, num_gpus=1, resources={"learner_node": 1},
                               object_store_memory=OBJECT_STORE_BYTES)
    rollout = cluster.add_node(num_cpus=2, num_gpus=2, resources={"rollout_node": 1},
                               object_store_memory=OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    try:
        ray.init(address=cluster.address, logging_level="WARNING",
                 runtime_env={"env_vars": {**QUIET_ENV, **TEST_ENV_VARS}})
        yield {"head": cluster.head_node.node_id, "learner": learner.node_id, "rollout": rollout.node_id,
               "cluster": cluster}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        if old_tmp is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmp


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def _gcs_node_of(actor) -> str:
    """The node of an actor busy in a long call (a rollout worker's `run`), which answers no other call meanwhile:
    from the GCS actor table (the state API would need the dashboard, which these nodes do not start)."""
    from ray._private.state import actors

    return actors(actor._actor_id.hex())["Address"]["NodeID"]


def test_plan_command_reads_the_live_nodes(three_nodes, capsys):
    from cli.main import main

    address = ray.get_runtime_context().gcs_address
    assert main(["plan", f"cluster.address={address}", "cluster.learner_resources={learner_node: 1}",
                 "cluster.rollout_resources={rollout_node: 1}"]) == 0
    out = capsys.readouterr().out
    # three nodes listed; the learner's bundle predicted on the node holding learner_node
    assert "learner: 1 bundle {CPU: 1, learner_node: 1}" in out
    assert "nodes: node 0" in out and "node 2" in out and "{CPU: 2, GPU: 1, learner_node: 1}" in out
    lines = out.splitlines()
    learner_line = lines[next(i for i, line in enumerate(lines) if line.startswith("learner:")) + 1]
    assert three_nodes["learner"][:8] in learner_line


def test_gpu_placement_groups_reserve_on_the_pinned_nodes(three_nodes):
    from cluster.placement import create_placement

    # one engine of tensor_parallel_size 2 (a STRICT_PACK group of two 1-GPU bundles) and one learner rank
    cfg = load_config(None, ["cluster.use_gpus=true", "rollout.tensor_parallel_size=2",
                             "cluster.learner_resources={learner_node: 1}", "cluster.rollout_resources={rollout_node: 1}"])
    placement = create_placement(cfg)
    try:
        assert placement.bundle_nodes("learner") == [three_nodes["learner"]]
        assert placement.bundle_nodes("rollout") == [three_nodes["rollout"]]
        [engine] = placement.groups["rollout"]
        table = ray.util.placement_group_table(engine)
        assert table["strategy"] == "STRICT_PACK" and set(table["bundles_to_node_id"].values()) == {three_nodes["rollout"]}
        assert [b.get("GPU") for b in engine.bundle_specs] == [1.0, 1.0]
        # the engine's actor holds no GPU: vLLM's Ray executor starts one worker per GPU bundle
        assert placement.options("rollout", 0)["num_gpus"] == 0 and placement.options("learner", 0)["num_gpus"] == 1
    finally:
        placement.remove()


def test_demo_job_trains_across_nodes(three_nodes, tmp_path):
    """Also: a fourth raylet joins mid-run, `relayrl scale` grows the rollout pool to 3 onto it (the only node with
    free `rollout_node`), and shrinks it back to 1 before the end; one of the two leaving workers is killed as
    the shrink is asked for, while it holds groups, so it dies during its drain."""
    from cli.main import main as cli_main

    cfg = load_config(None, [
        f"output_dir={tmp_path}", "logging.plots=false",
        "train.steps=20", "learner.prompts_per_step=16", "rollout.samples_per_prompt=8",
        "data.num_eval_prompts=20", "cluster.learner_resources={learner_node: 1}",
        "cluster.rollout_resources={rollout_node: 1}"])
    trainer = Trainer(cfg)
    cluster, joined, seen, killed = three_nodes["cluster"], [], {}, {}
    step = trainer.step

    def kill_a_leaving_worker_holding_groups() -> bool:
        """Kill rollout slot 1 or 2 (the two the shrink to 1 drains) once it holds leases, waiting up to 3 s."""
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for slot in (2, 1):
                worker_id = trainer.supervisor.rollout_ids[slot]
                if ray.get(trainer.controller.leases_of.remote(worker_id)):
                    ray.kill(trainer.rollout_workers[slot])
                    # the kill lands a moment later, and the worker may take more groups until then: what it holds
                    # is read once its run() has ended (a dead worker takes nothing more)
                    ray.wait([trainer.pools["rollout"].run_refs[slot]], timeout=60)
                    held = ray.get(trainer.controller.leases_of.remote(worker_id))
                    killed.update(id=worker_id, held=held, at=time.monotonic())
                    return True
            time.sleep(0.02)
        return False

    def wait_for_reports(worker_ids, timeout_s):
        deadline = time.monotonic() + timeout_s
        while not set(worker_ids) <= set(ray.get(trainer.controller.get_worker_stats.remote())):
            assert time.monotonic() < deadline, f"rollout workers {worker_ids} sent no report in {timeout_s} s"
            time.sleep(0.05)

    def record_done():
        done_file = tmp_path / "control" / "scale_done.json"
        for asked in [v for v in seen if "done" not in seen[v] and done_file.is_file()]:
            done = json.loads(done_file.read_text())
            if done["id"] == seen[asked]["id"]:  # the request made after that step has its result
                seen[asked].update(nodes=[_gcs_node_of(w) for w in trainer.rollout_workers], done=done)

    def step_then_scale(groups):
        record_done()
        joining = trainer.pools["rollout"].joining
        if joining is not None and trainer.version >= 7:
            # the grow asked for after step 5 starts its engines while training goes on (steps 6 and 7 at least);
            # once they serve, the run loop adds them after this step
            ray.wait(joining.probes, num_returns=len(joining.probes), timeout=600)
        metrics = step(groups)
        if trainer.version == 5:
            joined.append(cluster.add_node(num_cpus=2, resources={"rollout_node": 2},
                                           object_store_memory=OBJECT_STORE_BYTES))
            cluster.wait_for_nodes()
            seen[5] = {"id": 1}
            assert cli_main(["scale", str(tmp_path), "--rollout-workers", "3", "--wait", "0"]) == 0
        if trainer.version == 14 and len(trainer.rollout_workers) == 3:
            # the new engines load and check their first weights before their first sync, which carries their
            # report: on a loaded machine that can take past step 14, and a worker the shrink drains before it
            # reported would leave no weight probes to assert
            wait_for_reports(trainer.supervisor.rollout_ids[1:], timeout_s=300)
        # the shrink is asked for after a step at which a leaving worker holds groups (at most 3 s looked for
        # each step from 14): that worker is killed first, so its drain finds it dead with groups out
        if (14 <= trainer.version <= 17 and len(trainer.rollout_workers) == 3 and not killed
                and kill_a_leaving_worker_holding_groups()):
            seen[trainer.version] = {"id": 2}
            assert cli_main(["scale", str(tmp_path), "--rollout-workers", "1", "--wait", "0"]) == 0
        return metrics

    trainer.step = step_then_scale
    try:
        learner_node = _node_of(trainer.learner.ranks[0])
        rollout_node = _node_of(trainer.rollout_workers[0])
        summary = trainer.run()
        latest = ray.get(trainer.controller.latest_weights.remote(-1))
        version, refs = latest.version, latest.refs
        # the newest weights, put by learner rank 0, now also sit in the rollout node's object store
        locations = ray.experimental.get_object_locations(refs)
        worker_stats = ray.get(trainer.controller.get_worker_stats.remote())
        record_done()  # a drain that ended only at the run's end
    finally:
        trainer.shutdown()
        for node in joined:  # the module's later tests plan on the three nodes
            cluster.remove_node(node)
    # the pool grew onto the node that joined mid-run: slots 1 and 2 there, under the new ids 1 and 2; then both
    # left (one drained, one killed while draining)
    [new_node] = joined
    assert killed, "no leaving rollout worker held groups after steps 14 to 17: nothing was killed"
    (grow_step, grown), (shrink_step, shrunk) = sorted(seen.items())
    assert grow_step == 5 and grown["nodes"] == [three_nodes["rollout"], new_node.node_id, new_node.node_id]
    assert shrunk["nodes"] == [three_nodes["rollout"]]
    grow_done, shrink_done = grown["done"], shrunk["done"]
    assert (grow_done["rollout"], shrink_done["rollout"]) == (3, 1) and "error" not in grow_done
    assert grow_done["steps_while_resizing"] >= 2  # the learner trained on while the new engines started
    assert "error" not in shrink_done
    # the new workers loaded the weights and passed the sync check on what they loaded: their probe results reached
    # the driver's WeightCheck (a gap over the tolerance stops the run), from a version after they joined
    for worker_id in (1, 2):
        probes = worker_stats[worker_id]["weight_probes"]
        assert probes and min(p["version"] for p in probes) >= 5, (worker_id, probes)
    q = summary["queue"]
    dropped = sum(v for k, v in q.items() if k.startswith("queue/dropped_"))
    assert q["queue/admitted"] == q["queue/trained"] + dropped + q["queue/depth"], q
    assert len(summary["trained_group_ids"]) == len(set(summary["trained_group_ids"])) == q["queue/trained"]
    # the killed worker's groups were released as a dead worker's when its drain found it dead (not at the 120 s
    # drain timeout, and not replaced): at most the groups it held when it died
    assert 1 <= q["queue/dropped_rollout_worker_died"] <= len(killed["held"]), (q, killed)
    assert shrink_done["seconds"] < cfg.rollout.drain_timeout_s and summary["replaced_workers"]["rollout"] == 0
    print(f"\nmulti-node: a node joined after step 5; grow 1 -> 3 onto it {grow_done['seconds']:.1f} s "
          f"({grow_done['steps_while_resizing']} steps trained meanwhile); after step "
          f"{shrink_step} worker id {killed['id']} killed holding {len(killed['held'])} groups, drain 3 -> 1 "
          f"{shrink_done['seconds']:.1f} s ({q['queue/dropped_rollout_worker_died']} released as died, "
          f"{q.get('queue/dropped_rollout_worker_drained', 0)} as drained)")
    # pinned by the custom resources: learner on its node, rollout worker on the other
    assert learner_node == three_nodes["learner"] and rollout_node == three_nodes["rollout"]
    assert version == 20
    assert {three_nodes["learner"], three_nodes["rollout"]} <= set(locations[refs[0]]["node_ids"])
    report = summary["rollout"][0]
    assert report["versions_seen"][-1] >= 15, report["versions_seen"]  # it kept loading new versions
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    bytes_per_version = rows[-1]["weights/bytes"]
    assert bytes_per_version > 0 and all(r["weights/bytes"] == bytes_per_version for r in rows)
    # The weights that crossed the nodes are the learner's: the weight-sync check (on by default) scored its probe
    # in the engine after every version it loaded and compared it with the learner's log-probs (a gap over the
    # tolerance stops the run). That the demo learns is shown on one node (tests/test_pipeline.py), with the
    # same learner and the same weights.
    assert rows[-1]["weights/verify_checks"] >= 10, rows[-1]
    print(f"\nmulti-node: {bytes_per_version} bytes per version, {len(report['versions_seen']) - 1} versions "
          f"loaded across nodes and checked, {summary['wall_seconds']:.0f} s")


def test_ppo_with_reference_and_critic_on_their_nodes_checkpoints_and_resumes(three_nodes, tmp_path):
    """Every role of a ppo run pinned across the three nodes (learner and critic on the learner node, rollout and
    reference workers on the rollout node, reward worker on the head); a checkpoint written by ranks on another
    node than the driver's; the run resumed from it on the same cluster."""
    settings = [f"output_dir={tmp_path}", "logging.plots=false",
                "algorithm.preset=ppo", "critic.num_workers=1", "reference.num_workers=1",
                "train.save_every=3", "learner.prompts_per_step=8", "rollout.samples_per_prompt=8",
                "data.num_eval_prompts=20", "cluster.learner_resources={learner_node: 0.5}",
                "critic.resources={learner_node: 0.5}", "cluster.rollout_resources={rollout_node: 0.5}",
                "reference.resources={rollout_node: 0.5}"]
    trainer = Trainer(load_config(None, [*settings, "train.steps=6"]))
    trained: list = []
    step = trainer.step
    trainer.step = lambda groups: (trained.extend(groups), step(groups))[1]  # record what the learner trains on
    try:
        nodes = {role: _node_of(actor) for role, actor in (
            ("learner", trainer.learner.ranks[0]), ("critic", trainer.pools["critic"].group.ranks[0]),
            ("rollout", trainer.rollout_workers[0]), ("reference", trainer.reference_workers[0]),
            ("reward", trainer.reward_workers[0]))}
        summary = trainer.run()
    finally:
        trainer.shutdown()
    assert nodes == {"learner": three_nodes["learner"], "critic": three_nodes["learner"],
                     "rollout": three_nodes["rollout"], "reference": three_nodes["rollout"],
                     "reward": three_nodes["head"]}, nodes
    # reference log-probs from the rollout node's worker on every sample (the critic, on its node, valued each
    # batch at train time: its updates are the critic/* metrics)
    for t in [t for g in trained for t in g.trajectories]:
        assert t.ref_logprobs is not None and len(t.ref_logprobs) == len(t.response_token_ids)
    assert summary["steps"] == 6 and summary["reference_workers"]["reference_worker/groups"] >= len(trained)
    newest = tmp_path / "checkpoints" / "step_000006"
    assert (newest / "critic").is_dir() and (newest / "learner" / "rng_rank0.pt").is_file()

    resumed = Trainer(load_config(None, [*settings, "train.steps=8"]), resume_dir=tmp_path)
    try:
        final = resumed.run()
    finally:
        resumed.shutdown()
    assert final["resume"]["policy_version"] == 6 and final["steps"] == 8
    ids = final["trained_group_ids"]
    assert len(ids) == len(set(ids)) == 8 * 8  # 8 steps of 8 groups, each trained once across the resume
