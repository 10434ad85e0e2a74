"""Placement planning on fake node lists: bundles per role, refusals with the numbers, predicted packing."""

import pytest

from cli.main import main
from cluster.placement import Node, PlacementError, check_plan, parse_node_spec, plan_placement
from protocols.config import ConfigError, load_config


def gpu_config(*overrides: str):
    return load_config(None, ["cluster.use_gpus=true", "learner.prompts_per_step=64", *overrides])


def nodes(count: int, gpus: int, cpus: int = 64, **custom: float) -> list[Node]:
    return [Node(f"n{i}", {"GPU": float(gpus), "CPU": float(cpus), **custom}) for i in range(count)]


def test_gpu_plan_has_one_bundle_per_rank_and_per_engine():
    cfg = gpu_config("learner.num_ranks=4", "rollout.num_workers=3", "rollout.tensor_parallel_size=2",
                     "reward.num_workers=2", "cluster.learner_cpus=4")
    plan = plan_placement(cfg)
    assert plan.role("learner").bundles == [{"CPU": 4.0, "GPU": 1.0}] * 4
    assert plan.role("rollout").bundles == [{"CPU": 1.0, "GPU": 2.0}] * 3
    assert plan.role("reward").bundles == [{"CPU": 0.5}] * 2
    # GPUs: 4 ranks x 1 + 3 engines x 2 = 10; CPUs: 4 x 4 + 3 x 1 + 2 x 0.5 = 20
    assert plan.totals() == {"CPU": 20.0, "GPU": 10.0}


def test_gpu_engine_is_a_strict_pack_group_of_one_gpu_bundles():
    cfg = gpu_config("rollout.num_workers=2", "rollout.tensor_parallel_size=4", "cluster.rollout_cpus=8",
                     "cluster.rollout_resources={rollout_node: 1}")
    plan = plan_placement(cfg)
    # vLLM's Ray executor refuses bundles of more than one GPU: 4 bundles of 1 GPU, CPUs and pins in the first
    engine = ([{"CPU": 8.0, "rollout_node": 1.0, "GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}], "STRICT_PACK")
    assert plan.groups("rollout") == [engine, engine]
    # the learner's ranks share one PACK group
    assert plan.groups("learner") == [([{"CPU": 1.0, "GPU": 1.0}], "PACK")]


def test_cpu_plan_asks_only_for_cpus_with_fractions():
    cfg = load_config(None, ["rollout.num_workers=2", "reward.num_workers=3"])
    plan = plan_placement(cfg)
    assert all("GPU" not in b for r in plan.roles for b in r.bundles)
    # 2 engines x 1 + 1 rank x 1 + 3 reward workers x 0.5 = 4.5 CPUs
    assert plan.totals() == {"CPU": 4.5}


def test_too_many_gpus_is_refused_with_the_numbers():
    cfg = gpu_config("rollout.num_workers=8", "rollout.tensor_parallel_size=2", "learner.num_ranks=4")
    with pytest.raises(PlacementError) as err:
        check_plan(plan_placement(cfg), nodes(2, gpus=8))
    assert ("rollout.num_workers=8 x rollout.tensor_parallel_size=2 + learner.num_ranks=4 = 20 GPUs; "
            "the cluster has 16") in str(err.value)


def test_bundle_larger_than_any_node_is_refused():
    cfg = gpu_config("rollout.num_workers=1", "rollout.tensor_parallel_size=16", "learner.num_ranks=1")
    # 17 GPUs would fit three 8-GPU nodes in total, but one engine's 16 GPUs must share a node
    with pytest.raises(PlacementError, match="rollout.tensor_parallel_size=16 needs 16 GPUs on one node; "
                                             "the largest node has 8"):
        check_plan(plan_placement(cfg), nodes(3, gpus=8))


def test_too_many_cpus_is_refused_with_the_numbers():
    cfg = load_config(None, ["rollout.num_workers=3", "reward.num_workers=2", "cluster.rollout_cpus=2"])
    # 3 x 2 + 1 x 1 + 2 x 0.5 = 8 CPUs against 4
    with pytest.raises(PlacementError, match=r"rollout.num_workers=3 x cluster.rollout_cpus=2 \+ learner.num_ranks=1 "
                                             r"x cluster.learner_cpus=1 \+ reward.num_workers=2 x "
                                             r"cluster.reward_cpus=0.5 = 8 CPUs; the cluster has 4"):
        check_plan(plan_placement(cfg), [Node("local", {"CPU": 4.0})])


def test_plan_that_fits_totals_but_cannot_pack_is_refused():
    # three 3-GPU nodes = 9 GPUs = 4 engines x 2 + 1 rank; but each node holds only one 2-GPU engine
    cfg = gpu_config("rollout.num_workers=4", "rollout.tensor_parallel_size=2", "learner.num_ranks=1")
    with pytest.raises(PlacementError, match="do not pack"):
        check_plan(plan_placement(cfg), nodes(3, gpus=3))


def test_learner_ranks_pack_on_one_node_and_engines_take_whole_bundles():
    cfg = gpu_config("rollout.num_workers=6", "rollout.tensor_parallel_size=2", "learner.num_ranks=4")
    where = check_plan(plan_placement(cfg), nodes(2, gpus=8))
    # 4 ranks on one node (PACK); each engine's 2 GPUs in one bundle; 6 x 2 + 4 = 16 GPUs = both nodes full
    assert len(set(where["learner"])) == 1
    per_node = {n: 0 for n in ("n0", "n1")}
    for n in where["learner"]:
        per_node[n] += 1
    for n in where["rollout"]:
        per_node[n] += 2
    assert per_node == {"n0": 8, "n1": 8}


def test_custom_resources_pin_roles_to_nodes():
    cfg = load_config(None, ["rollout.num_workers=2", "cluster.learner_resources={learner_node: 1}",
                             "cluster.rollout_resources={rollout_node: 1}"])
    cluster = [Node("head", {"CPU": 4.0}), Node("a", {"CPU": 2.0, "learner_node": 1.0}),
               Node("b", {"CPU": 2.0, "rollout_node": 2.0})]
    where = check_plan(plan_placement(cfg), cluster)
    assert where["learner"] == ["a"] and where["rollout"] == ["b", "b"]


def test_missing_custom_resource_is_named():
    cfg = load_config(None, ["cluster.learner_resources={learner_node: 1}"])
    with pytest.raises(PlacementError, match="cluster.learner_resources.learner_node=1 needs 1 of resource "
                                             "'learner_node' on one node; the largest node has 0"):
        check_plan(plan_placement(cfg), [Node("local", {"CPU": 8.0})])


def test_builtin_names_are_refused_as_custom_resources():
    with pytest.raises(ConfigError, match="cluster.rollout_resources names the built-in resource 'GPU'"):
        load_config(None, ["cluster.rollout_resources={GPU: 2}"])


def test_node_spec_parses_counts_and_custom_names():
    cluster = parse_node_spec("2xGPU=8,CPU=96,learner_node=4")
    assert [n.resources for n in cluster] == [{"GPU": 8.0, "CPU": 96.0, "learner_node": 4.0}] * 2
    with pytest.raises(ValueError, match="NAME=AMOUNT"):
        parse_node_spec("2xGPU")


def test_plan_command_prints_nodes_and_refuses_with_exit_code(capsys):
    assert main(["plan", "--node", "1xGPU=8,CPU=64", "cluster.use_gpus=true", "learner.num_ranks=4",
                 "learner.prompts_per_step=64", "rollout.num_workers=4"]) == 0
    out = capsys.readouterr().out
    # 4 ranks + 4 engines x 1 GPU = 8 GPUs of 8; CPUs 4 + 4 + 0.5 = 8.5
    assert "learner: 4 bundles {CPU: 1, GPU: 1}" in out and "bundles 0-3" in out
    assert "8.5 CPUs of 64, 8 GPUs of 8" in out
    assert main(["plan", "--node", "1xGPU=8,CPU=64", "cluster.use_gpus=true", "rollout.num_workers=8"]) == 3
    assert "rollout.num_workers=8 x rollout.tensor_parallel_size=1 + learner.num_ranks=1 = 9 GPUs; the cluster " \
           "has 8" in capsys.readouterr().err


@pytest.mark.slow
def test_trainer_refuses_an_impossible_plan_before_any_actor_starts(ray_cluster, tmp_path):
    from cluster.trainer import Trainer
    from ray.util import placement_group_table

    # the session cluster has 8 CPUs: 9 engines x 1 + 1 rank x 1 + 1 reward worker x 0.5 = 10.5
    cfg = load_config(None, [f"output_dir={tmp_path}", "rollout.num_workers=9"])
    groups_before = len(placement_group_table())
    free_before = ray_cluster.available_resources()["CPU"]
    with pytest.raises(PlacementError, match=r"rollout.num_workers=9 x cluster.rollout_cpus=1 .* = 10.5 CPUs; "
                                             r"the cluster has 8"):
        Trainer(cfg)
    assert len(placement_group_table()) == groups_before  # nothing reserved
    # a previous test's actors may still be releasing CPUs, so free CPUs can only rise, never fall
    assert ray_cluster.available_resources()["CPU"] >= free_before


@pytest.mark.slow
def test_reservation_that_cannot_be_met_times_out_naming_the_setting(ray_cluster):
    from ray.util import placement_group, placement_group_table, remove_placement_group

    from cluster.placement import create_placement

    # another job holds 7 of the 8 CPUs: the plan's 2.5 CPUs fit the totals but not what is free
    holder = placement_group([{"CPU": 7.0}])
    ray_cluster.get(holder.ready(), timeout=60)
    cfg = load_config(None, ["cluster.placement_timeout_s=2"])
    try:
        with pytest.raises(PlacementError, match=r"cluster.placement_timeout_s=2 s"):
            create_placement(cfg)
        # the groups it asked for were removed, not left pending
        states = [g["state"] for g in placement_group_table().values()]
        assert states.count("PENDING") == 0
    finally:
        remove_placement_group(holder)



@pytest.mark.slow
def test_gpu_run_on_a_machine_without_gpus_is_refused_before_ray_starts(tmp_path):
    import os
    import subprocess
    import sys

    import torch

    from tests.conftest import REPO

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    # the command line a user types, in a fresh process (no Ray running there, none started)
    done = subprocess.run([sys.executable, "-m", "cli.main", "train", f"--output-dir={tmp_path}",
                           "cluster.use_gpus=true", "cluster.num_cpus=8"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 3, done.stderr[-3000:]
    # 1 engine x 1 GPU + 1 rank = 2 GPUs
    assert ("cluster.use_gpus=true asks for rollout.num_workers=1 x rollout.tensor_parallel_size=1 + "
            "learner.num_ranks=1 = 2 GPUs; the cluster has 0") in done.stderr
    assert "Started a local Ray instance" not in done.stderr + done.stdout


def test_a_rollout_resize_past_the_nodes_is_refused_with_the_numbers_and_one_that_fits_passes():
    from cluster.placement import check_pool_sizes, resource_request

    cfg = gpu_config("learner.num_ranks=2", "rollout.num_workers=2", "reward.num_workers=2")
    # one 8-GPU node: 2 ranks + 6 engines of 1 GPU = 8 fits; 7 engines = 9 GPUs does not
    check_pool_sizes(cfg, {"rollout": 6}, nodes(1, gpus=8))
    with pytest.raises(PlacementError, match=r"rollout.num_workers=7 x rollout.tensor_parallel_size=1 \+ "
                                             r"learner.num_ranks=2 = 9 GPUs; the cluster has 8 \(on 1 node\)"):
        check_pool_sizes(cfg, {"rollout": 7}, nodes(1, gpus=8))
    # what Ray's autoscaler is asked for: the whole run at the new size, one bundle per actor
    # (2 learner ranks, 3 engines, 2 reward workers, in the plan's role order)
    bundles = resource_request(cfg, {"rollout": 3, "reward": 2})
    assert bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"CPU": 1.0, "GPU": 1.0}] * 3 + [{"CPU": 0.5}] * 2
