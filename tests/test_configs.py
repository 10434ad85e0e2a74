"""Every shipped config validates and its placement fits the cluster its comments describe (`# plan-for:`)."""

from pathlib import Path

import pytest

from cluster.placement import PlacementError, check_plan, parse_node_spec, plan_placement
from protocols.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "configs").glob("*.yaml"))
GPU_CONFIGS = [p for p in CONFIGS if "# plan-for:" in p.read_text()]
"""The GPU configs; the others (the CPU demos) are checked below."""


def planned_nodes(path: Path):
    specs = [line.split(":", 1)[1].strip() for line in path.read_text().splitlines() if line.startswith("# plan-for:")]
    nodes = [n for spec in specs for n in parse_node_spec(spec)]
    return [type(n)(f"node{i}", n.resources) for i, n in enumerate(nodes)]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    assert load_config(path).output_dir


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_shipped_gpu_config_fills_the_cluster_it_describes(path):
    cfg = load_config(path)
    nodes = planned_nodes(path)
    assert cfg.cluster.use_gpus and nodes, f"{path.name}: a GPU config needs a `# plan-for: NxGPU=..` line"
    plan = plan_placement(cfg)
    where = check_plan(plan, nodes)
    # sized to use every GPU it describes, with the learner ranks packed on one node
    assert plan.totals()["GPU"] == sum(n.resources["GPU"] for n in nodes)
    assert len(set(where["learner"])) == 1


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_refused_on_half_the_gpus(path):
    cfg = load_config(path)
    half = [type(n)(n.node_id, {**n.resources, "GPU": n.resources["GPU"] / 2}) for n in planned_nodes(path)]
    with pytest.raises(PlacementError, match="GPUs; the cluster has"):
        check_plan(plan_placement(cfg), half)


def test_two_node_7b_config_pins_learner_and_rollout_to_their_nodes():
    path = next(p for p in CONFIGS if p.name == "qwen2.5-7b_2nodes.yaml")
    where = check_plan(plan_placement(load_config(path)), planned_nodes(path))
    # node0 carries learner_node, node1 rollout_node (the plan-for lines, in order)
    assert set(where["learner"]) == {"node0"} and set(where["rollout"]) == {"node1"}


def test_longcot_demo_config_sets_staleness_by_the_long_tail_rule():
    from rewards.longcot_data import longcot_problems, solution_text

    cfg = load_config(next(p for p in CONFIGS if p.name == "demo_longcot.yaml"))
    assert cfg.data.format == "longcot" and cfg.reward.verifier == "longcot"
    assert cfg.learner.packing and cfg.learner.max_tokens_per_micro_batch > 0
    pairs = longcot_problems("train", cfg.data.longcot_num_train, long_fraction=cfg.data.longcot_long_fraction,
                             max_b=cfg.data.longcot_max_b)
    lengths = [len(solution_text(a, b)) + 1 for a, b in pairs]
    # every written-out solution fits the response budget, and prompt + response the model's context
    assert max(lengths) <= cfg.rollout.max_response_tokens
    assert cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens <= cfg.model.demo.max_position_embeddings
    # README: k = (longest / mean length) x (engine slots / samples per batch) + 1
    slots = min(cfg.rollout.max_num_seqs, cfg.rollout.prompts_in_flight * cfg.rollout.samples_per_prompt)
    rule = max(lengths) / (sum(lengths) / len(lengths)) * slots / cfg.samples_per_step + 1
    assert cfg.train.max_staleness == int(rule)
