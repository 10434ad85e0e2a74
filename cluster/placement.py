"""Placement: which resources each actor group reserves, checked against the cluster before any actor starts.

One placement group per role: the learner ranks (one GPU each, packed on as few nodes as possible) and the reward
workers (CPUs); on GPUs each rollout engine gets a placement group of its own, rollout.tensor_parallel_size
one-GPU bundles on one node (STRICT_PACK), the shape vLLM's Ray executor requires for its tensor-parallel workers
(it refuses bundles of more than one GPU and takes the actor's current placement group). On CPU runs the engines
share one group of CPU bundles. Planning and checking are pure functions over node lists, so they run without
Ray (tests, `relayrl plan` with `--node`); `create_placement` reserves the groups on a running cluster.
"""

import math
import os
import re
from dataclasses import dataclass, field

from protocols.config import RunConfig
from protocols.trajectory import TOKEN_SCORERS

ROLES = ("rollout", "learner", "reward", "critic", *TOKEN_SCORERS)
"""Every actor group with a placement of its own; `critic` and the frozen token scorers (reference, teacher) only
when their num_workers > 0."""
STRATEGY = "PACK"
"""Every role's group packs its bundles on as few nodes as possible (Ray's PACK, best effort): learner ranks on
one node talk over NVLink rather than the network. Each engine is one bundle, so its GPUs share a node."""


HIDDEN_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
"""The environment of an actor that holds no GPU. Ray 2.60 no longer blanks CUDA_VISIBLE_DEVICES for an actor with
num_gpus=0 (ray/_private/accelerators/accelerator.py, ray-project/ray#54868), so without it such an actor sees
every GPU of its node, and a stray CUDA context (pinned host memory, a library's torch.cuda call) lands on GPU 0
beside an engine or a learner rank."""


def gpu_visibility(num_gpus: float, tensor_parallel_engine: bool = False) -> dict:
    """Ray options that hide the node's GPUs from an actor holding none. Not for a tensor-parallel engine's actor
    on GPUs, which holds none itself: vLLM copies that actor's runtime_env into its Ray workers (EngineArgs'
    ray_runtime_env) and has Ray leave their CUDA_VISIBLE_DEVICES alone (RayExecutorV2), so a blank there would
    hide every GPU from the workers that hold them."""
    if num_gpus > 0 or tensor_parallel_engine:
        return {}
    return {"runtime_env": {"env_vars": dict(HIDDEN_GPUS)}}


def with_env(options: dict, env: dict[str, str]) -> dict:
    """Ray `options` with `env` added to their runtime_env's env_vars (an actor's own runtime_env would otherwise
    replace the one in `options`)."""
    runtime_env = dict(options.get("runtime_env", {}))
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
    return {**options, "runtime_env": runtime_env}


class PlacementError(ValueError):
    """A plan the cluster can never hold, or a reservation that timed out; the message names the settings."""


@dataclass(frozen=True)
class Node:
    """One Ray node: its id, its total resources (`CPU`, `GPU`, custom names) and its address if known."""

    node_id: str
    resources: dict[str, float]
    address: str = ""


@dataclass
class RolePlan:
    """The resources one actor group reserves: bundles[i] is all that actor i holds, on one node."""

    role: str
    bundles: list[dict[str, float]]
    split_gpus: bool = False
    """Reserve each actor's share as a STRICT_PACK group of its own, one bundle per GPU (rollout engines on GPUs)."""
    terms: dict[str, str] = field(default_factory=dict)
    """Per resource, the settings that size this role's demand, e.g. GPU -> "learner.num_ranks=4"."""
    shape: dict[str, str] = field(default_factory=dict)
    """Per resource, the settings that size one bundle (for "needs N on one node" errors)."""


@dataclass
class PlacementPlan:
    roles: list[RolePlan]

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)

    def groups(self, name: str) -> list[tuple[list[dict[str, float]], str]]:
        """The placement groups of role `name` as (bundles, strategy): one PACK group holding a bundle per actor,
        or, for split_gpus, one STRICT_PACK group per actor whose first bundle also holds the CPUs and custom
        resources."""
        role = self.role(name)
        if not role.split_gpus:
            return [(role.bundles, STRATEGY)]
        out = []
        for whole in role.bundles:
            gpus = int(whole.get("GPU", 0))
            first = {k: v for k, v in whole.items() if k != "GPU"} | ({"GPU": 1.0} if gpus else {})
            out.append(([first] + [{"GPU": 1.0} for _ in range(gpus - 1)], "STRICT_PACK"))
        return out

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role in self.roles:
            for bundle in role.bundles:
                for name, amount in bundle.items():
                    out[name] = out.get(name, 0.0) + amount
        return out


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _role_plan(role: str, count: str, n: int, cpus: str, cpu_amount: float, custom: str,
               custom_amounts: dict[str, float], gpus: float = 0.0, gpu_count: str = "", gpu_shape: str = "",
               split_gpus: bool = False) -> RolePlan:
    """n equal bundles; `count`, `cpus`, `custom` name the settings that size them (for the error messages)."""
    bundle = {"CPU": cpu_amount, **({"GPU": gpus} if gpus else {}), **custom_amounts}
    terms = {"CPU": f"{count}={n} x {cpus}={_number(cpu_amount)}", "GPU": gpu_count,
             **{k: f"{count}={n} x {custom}.{k}={_number(v)}" for k, v in custom_amounts.items()}}
    shape = {"CPU": f"{cpus}={_number(cpu_amount)}", "GPU": gpu_shape,
             **{k: f"{custom}.{k}={_number(v)}" for k, v in custom_amounts.items()}}
    return RolePlan(role, [dict(bundle) for _ in range(n)], split_gpus=split_gpus, terms=terms, shape=shape)


def plan_placement(cfg: RunConfig, roles: tuple[str, ...] = ROLES) -> PlacementPlan:
    """The bundles `cfg` asks for, role by role (no cluster needed)."""
    c, on_gpus = cfg.cluster, cfg.cluster.use_gpus
    n_learn, n_roll, tp = cfg.learner.num_ranks, cfg.rollout.num_workers, cfg.rollout.tensor_parallel_size
    plans = {
        "learner": _role_plan("learner", "learner.num_ranks", n_learn, "cluster.learner_cpus", c.learner_cpus,
                              "cluster.learner_resources", c.learner_resources, gpus=1.0 if on_gpus else 0.0,
                              gpu_count=f"learner.num_ranks={n_learn}", gpu_shape="one learner rank"),
        "rollout": _role_plan("rollout", "rollout.num_workers", n_roll, "cluster.rollout_cpus", c.rollout_cpus,
                              "cluster.rollout_resources", c.rollout_resources, gpus=float(tp) if on_gpus else 0.0,
                              gpu_count=f"rollout.num_workers={n_roll} x rollout.tensor_parallel_size={tp}",
                              gpu_shape=f"rollout.tensor_parallel_size={tp}", split_gpus=on_gpus),
        "reward": _role_plan("reward", "reward.num_workers", cfg.reward.num_workers, "cluster.reward_cpus",
                             c.reward_cpus, "cluster.reward_resources", c.reward_resources),
        # Critic ranks: one GPU each, like learner ranks (DeepSpeed data parallel).
        "critic": _role_plan("critic", "critic.num_workers", cfg.critic.num_workers, "critic.cpus", cfg.critic.cpus,
                             "critic.resources", cfg.critic.resources, gpus=1.0 if on_gpus else 0.0,
                             gpu_count=f"critic.num_workers={cfg.critic.num_workers}", gpu_shape="one critic rank"),
    }
    for name in TOKEN_SCORERS:
        frozen = getattr(cfg, name)
        if frozen.num_workers:  # one bundle per worker, each a whole copy of its model (plain data parallel)
            plans[name] = _role_plan(name, f"{name}.num_workers", frozen.num_workers, f"{name}.cpus", frozen.cpus,
                                     f"{name}.resources", frozen.resources, gpus=frozen.gpus if on_gpus else 0.0,
                                     gpu_count=f"{name}.num_workers={frozen.num_workers} x {name}.gpus="
                                               f"{_number(frozen.gpus)}",
                                     gpu_shape=f"{name}.gpus={_number(frozen.gpus)}")
    if not cfg.critic.num_workers:
        del plans["critic"]
    return PlacementPlan([plans[r] for r in roles if r in plans])


# --- checking a plan against nodes ----------------------------------------------------------------------------
_EPS = 1e-9
_FROZEN = " / ".join(TOKEN_SCORERS)
_FIX = {"GPU": "lower rollout.num_workers, rollout.tensor_parallel_size, learner.num_ranks, critic.num_workers or "
               f"the num_workers of {_FROZEN} (or their gpus), or add GPU nodes",
        "CPU": "lower the worker counts or cluster.learner_cpus / rollout_cpus / reward_cpus / critic.cpus / "
               f"the cpus of {_FROZEN}, or add nodes (locally: raise cluster.num_cpus)"}


def _unit(name: str, amount: float) -> str:
    plural = "s" if amount != 1 else ""
    return f"{_number(amount)} {name}{plural}" if name in ("CPU", "GPU") else f"{_number(amount)} of resource {name!r}"


def _fits(bundle: dict[str, float], free: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in bundle.items())


def check_totals(plan: PlacementPlan, nodes: list[Node]) -> None:
    """Every resource the plan asks for, summed over roles, against the cluster's total."""
    have: dict[str, float] = {}
    for node in nodes:
        for k, v in node.resources.items():
            have[k] = have.get(k, 0.0) + v
    for name, need in sorted(plan.totals().items(), key=lambda kv: (kv[0] != "GPU", kv[0] != "CPU", kv[0])):
        if need <= have.get(name, 0.0) + _EPS:
            continue
        fix = _FIX.get(name, f"start nodes with `ray start --resources '{{\"{name}\": N}}'` or change the "
                             "cluster.*_resources settings that ask for it")
        raise PlacementError(f"{_demand(plan, name)}; the cluster has {_number(have.get(name, 0.0))} "
                             f"(on {len(nodes)} node{'s' if len(nodes) != 1 else ''}). Fix: {fix}.")


def _demand(plan: PlacementPlan, name: str) -> str:
    """'rollout.num_workers=8 x rollout.tensor_parallel_size=2 + learner.num_ranks=4 = 20 GPUs'."""
    terms = " + ".join(r.terms[name] for r in plan.roles if r.bundles and name in r.bundles[0])
    return f"{terms} = {_unit(name, plan.totals().get(name, 0.0))}"


def check_bundles(plan: PlacementPlan, nodes: list[Node]) -> None:
    """Every bundle must fit on one node by itself (a bundle never spans nodes)."""
    for role in plan.roles:
        if not role.bundles:
            continue
        bundle = role.bundles[0]
        if any(_fits(bundle, n.resources) for n in nodes):
            continue
        for name, need in bundle.items():
            largest = max((n.resources.get(name, 0.0) for n in nodes), default=0.0)
            if name == "GPU" and largest == 0:
                raise PlacementError(
                    f"cluster.use_gpus=true asks for {_demand(plan, 'GPU')}; the cluster has 0 (no node of the "
                    f"cluster has a GPU). Fix: set cluster.use_gpus=false to run on CPUs, or join a GPU cluster "
                    f"with cluster.address.")
            if need > largest + _EPS:
                raise PlacementError(
                    f"{role.shape[name]} needs {_unit(name, need)} on one node; the largest node has "
                    f"{_number(largest)}. Fix: lower {role.shape[name].split('=')[0]} or add larger nodes.")
        raise PlacementError(
            f"one {role.role} bundle {_bundle_text(bundle)} fits on no single node, though each resource fits on "
            f"some node: nodes are {[_bundle_text(n.resources) for n in nodes]}. Fix: change the cluster.*_resources "
            f"or CPU settings of the {role.role} role so that one node holds all of it.")


def assign_bundles(plan: PlacementPlan, nodes: list[Node]) -> dict[str, list[str]]:
    """A predicted node per bundle ({role: [node_id per bundle]}), first-fit with the largest bundles first and
    each role preferring nodes it already uses (PACK). Ray decides the real placement; this finds plans that
    pass the totals and per-bundle checks but still cannot be packed (three 2-GPU engines on two 3-GPU nodes)."""
    free = {n.node_id: dict(n.resources) for n in nodes}
    order = sorted(((r.role, i, b) for r in plan.roles for i, b in enumerate(r.bundles)),
                   key=lambda x: (-x[2].get("GPU", 0.0), -x[2].get("CPU", 0.0)))
    out: dict[str, list[str]] = {r.role: [""] * len(r.bundles) for r in plan.roles}
    for role, index, bundle in order:
        used = [nid for nid in out[role] if nid]
        candidates = sorted(free, key=lambda nid: (nid not in used, -free[nid].get("GPU", 0.0) if "GPU" in bundle
                                                   else -free[nid].get("CPU", 0.0)))
        target = next((nid for nid in candidates if _fits(bundle, free[nid])), None)
        if target is None:
            raise PlacementError(
                f"the plan fits the cluster's totals but its bundles do not pack onto the nodes: no node has "
                f"{_bundle_text(bundle)} left for {role} bundle {index} (free after the larger bundles: "
                f"{ {nid[:8]: _bundle_text(f) for nid, f in free.items()} }). Fix: make engines and node sizes "
                "divide evenly (rollout.tensor_parallel_size), or lower the worker counts.")
        for k, v in bundle.items():
            free[target][k] = free[target].get(k, 0.0) - v
        out[role][index] = target
    return out


def check_plan(plan: PlacementPlan, nodes: list[Node]) -> dict[str, list[str]]:
    """Refuse a plan the nodes can never hold (PlacementError with the numbers); return the predicted nodes."""
    if not nodes:
        raise PlacementError("the cluster has no alive nodes; check cluster.address and `ray status`")
    # A bundle larger than every node first: adding nodes of the same size would not help.
    check_bundles(plan, nodes)
    check_totals(plan, nodes)
    return assign_bundles(plan, nodes)


def resized_plan(cfg: RunConfig, sizes: dict[str, int]) -> PlacementPlan:
    """The run's plan with `sizes` ({role: num_workers}) in place of the launch sizes."""
    update = {role: getattr(cfg, role).model_copy(update={"num_workers": n}) for role, n in sizes.items()}
    return plan_placement(cfg.model_copy(update=update))


def check_pool_sizes(cfg: RunConfig, sizes: dict[str, int], nodes: list[Node]) -> None:
    """Refuse pool sizes the nodes can never hold beside the rest of the run: the run's plan with `sizes`
    ({role: num_workers}, e.g. a rollout resize) in place of the launch sizes, checked as at launch (PlacementError
    naming the settings, the demand and what the nodes have)."""
    check_plan(resized_plan(cfg, sizes), nodes)


def resource_request(cfg: RunConfig, sizes: dict[str, int]) -> list[dict[str, float]]:
    """The bundles of the whole run with `sizes` in place of the launch sizes, one per actor (an engine's GPUs in
    one bundle: they share a node), for `ray.autoscaler.sdk.request_resources`, which sizes the cluster to hold all
    of them at once."""
    return [dict(b) for role in resized_plan(cfg, sizes).roles for b in role.bundles]


def _bundle_text(bundle: dict[str, float]) -> str:
    shown = sorted((k, v) for k, v in bundle.items() if not _is_internal(k))
    shown.sort(key=lambda kv: (kv[0] != "CPU", kv[0] != "GPU"))  # CPU, GPU, then custom names A-Z
    return "{" + ", ".join(f"{k}: {_number(v)}" for k, v in shown) + "}"


def _is_internal(name: str) -> bool:
    return name in ("memory", "object_store_memory") or name.startswith("node:") or "_group_" in name


# --- node lists -------------------------------------------------------------------------------------------------
_NODE_SPEC = re.compile(r"^(?:(\d+)x)?(.+)$")


def parse_node_spec(spec: str) -> list[Node]:
    """`2xGPU=8,CPU=96` -> two nodes of 8 GPUs and 96 CPUs each (offline planning; custom names allowed)."""
    match = _NODE_SPEC.match(spec.strip())
    count = int(match.group(1) or 1)
    resources: dict[str, float] = {}
    for item in match.group(2).split(","):
        name, sep, amount = item.partition("=")
        try:
            resources[name.strip()] = float(amount)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"node spec {spec!r}: {item!r} must look like NAME=AMOUNT, e.g. 2xGPU=8,CPU=96")
    return [Node(f"node{i}", dict(resources)) for i in range(count)]


def node_resources(cfg: RunConfig, num_nodes: int) -> list[dict[str, float]]:
    """The custom resources to start each of `num_nodes` fresh Ray nodes with (a SLURM allocation), so that the
    roles pinned by cluster.*_resources can be placed: the names one role's bundle asks for together share a node;
    each such set takes the next node in the amount the whole plan asks for, the learner's first (so the head,
    where the driver runs, is the learner's node, as deploy/configs/qwen2.5-7b_2nodes.yaml describes), then in
    role order; the nodes after them get none (the unpinned roles fill the rest). PlacementError when there are
    more sets than nodes."""
    plan = plan_placement(cfg)
    sets: list[set[str]] = []
    setting: dict[str, str] = {}  # resource name -> the setting that asks for it, e.g. cluster.learner_resources.x
    for role in sorted(plan.roles, key=lambda r: r.role != "learner"):
        names = {k for k in (role.bundles[0] if role.bundles else {}) if k not in ("CPU", "GPU")}
        for name in names:
            setting.setdefault(name, role.shape[name].split("=")[0])
        joined = [i for i, s in enumerate(sets) if s & names]
        if not joined:
            sets += [names] if names else []
            continue
        sets[joined[0]] = names.union(*(sets[i] for i in joined))
        sets = [s for i, s in enumerate(sets) if i not in joined[1:]]
    if len(sets) > num_nodes:
        named = ", ".join(setting[n] for s in sets for n in sorted(s))
        raise PlacementError(
            f"{named} pin roles to {len(sets)} different nodes, but the allocation has {num_nodes}. Fix: "
            f"allocate {len(sets)} nodes, give those roles the same resource name, or set RELAYRL_NODE_RESOURCES "
            "(one JSON object per node) to start the nodes with resources of your choice.")
    totals = plan.totals()
    return [{n: totals[n] for n in sorted(s)} for s in sets] + [{} for _ in range(num_nodes - len(sets))]


def local_nodes(cfg: RunConfig) -> list[Node]:
    """The one node the embedded cluster would start with (see ray_setup.start_ray)."""
    resources = {"CPU": float(cfg.cluster.num_cpus or max(8, os.cpu_count() or 1))}
    if cfg.cluster.use_gpus:
        import torch

        resources["GPU"] = float(torch.cuda.device_count())
    return [Node("local", resources, "127.0.0.1")]


def nodes_from_ray() -> list[Node]:
    """Alive nodes of the connected Ray cluster with their total resources (node:* markers dropped)."""
    import ray

    return [Node(n["NodeID"], {k: float(v) for k, v in n["Resources"].items() if not _is_internal(k)},
                 n.get("NodeManagerAddress", ""))
            for n in ray.nodes() if n.get("Alive")]


def describe(plan: PlacementPlan, nodes: list[Node], assignment: dict[str, list[str]] | None) -> str:
    """Human-readable plan: per role its bundles and (predicted or actual) nodes, then totals against the nodes."""
    names = {n.node_id: f"node {i} ({n.address + ', ' if n.address else ''}{n.node_id[:8]})"
             for i, n in enumerate(nodes)}
    lines = []
    for role in plan.roles:
        if role.split_gpus:
            lines.append(f"{role.role}: {len(role.bundles)} engine{'s' if len(role.bundles) != 1 else ''} "
                         f"{_bundle_text(role.bundles[0])} on one node each (a STRICT_PACK group per engine)")
        else:
            lines.append(f"{role.role}: {len(role.bundles)} bundle{'s' if len(role.bundles) != 1 else ''} "
                         f"{_bundle_text(role.bundles[0]) if role.bundles else ''}, strategy {STRATEGY}")
        if assignment:
            per_node: dict[str, list[int]] = {}
            for i, nid in enumerate(assignment[role.role]):
                per_node.setdefault(nid, []).append(i)
            unit = "engines" if role.split_gpus else "bundles"
            for nid, idx in per_node.items():
                lines.append(f"  {names.get(nid, nid)}: {unit} {_ranges(idx)}")
    totals = plan.totals()
    have = {k: sum(n.resources.get(k, 0.0) for n in nodes) for k in totals}
    lines.append("total: " + ", ".join(f"{_unit(k, v)} of {_number(have[k])}" for k, v in totals.items()))
    lines.append("nodes: " + "; ".join(f"{names[n.node_id]} {_bundle_text(n.resources)}" for n in nodes))
    return "\n".join(lines)


def _ranges(idx: list[int]) -> str:
    parts, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [math.inf]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def precheck_embedded(cfg: RunConfig) -> None:
    """Before Ray starts: refuse a plan the embedded cluster this run would start could never hold, so a CPU
    machine refuses `cluster.use_gpus: true` at once rather than after building the model."""
    import ray

    if ray.is_initialized() or cfg.cluster.address or os.environ.get("RAY_ADDRESS"):
        return  # a cluster to join: checked against its real nodes by create_placement
    check_plan(plan_placement(cfg), local_nodes(cfg))


# --- reserving on a running cluster -----------------------------------------------------------------------------
class Placement:
    """The placement groups of one run, by role; `options(role, i)` schedules actor i into its bundle."""

    def __init__(self, plan: PlacementPlan, groups: dict[str, list]) -> None:
        self.plan = plan
        self.groups = groups

    def _slot(self, role: str, index: int) -> tuple:
        """(placement group, bundle index) of actor `index`."""
        if self.plan.role(role).split_gpus:
            return self.groups[role][index], 0
        return self.groups[role][0], index

    def options(self, role: str, index: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        whole = self.plan.role(role).bundles[index]
        gpus = whole.get("GPU", 0.0)
        tensor_parallel_engine = self.plan.role(role).split_gpus and gpus > 1
        if tensor_parallel_engine:
            # vLLM's Ray executor starts one worker per GPU bundle of this group; the actor holding the engine
            # needs no GPU of its own.
            gpus = 0.0
        group, bundle = self._slot(role, index)
        # The actor takes its bundle's CPUs and GPUs; the custom resources already pinned the bundle to its node.
        return {"num_cpus": whole.get("CPU", 0.0), "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundle),
                **gpu_visibility(gpus, tensor_parallel_engine)}

    def bundle_nodes(self, role: str) -> list[str]:
        """Node id of each actor's bundle of `role`, as Ray placed them."""
        from ray.util import placement_group_table

        nodes = []
        for index in range(len(self.plan.role(role).bundles)):
            group, bundle = self._slot(role, index)
            nodes.append(placement_group_table(group)["bundles_to_node_id"][bundle])
        return nodes

    def remove(self) -> None:
        from ray.util import remove_placement_group

        for groups in self.groups.values():
            for pg in groups:
                remove_placement_group(pg)
        self.groups = {}


def create_placement(cfg: RunConfig, roles: tuple[str, ...] = ROLES) -> Placement:
    """Check the plan against the connected cluster, then reserve the placement groups, waiting at most
    cluster.placement_timeout_s. Raises PlacementError (nothing left reserved) when it cannot."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util import placement_group, remove_placement_group

    plan = plan_placement(cfg, roles)
    nodes = nodes_from_ray()
    check_plan(plan, nodes)
    groups = {r.role: [placement_group(bundles, strategy=strategy) for bundles, strategy in plan.groups(r.role)]
              for r in plan.roles if r.bundles}
    try:
        ray.get([pg.ready() for pgs in groups.values() for pg in pgs], timeout=cfg.cluster.placement_timeout_s)
    except GetTimeoutError:
        for pgs in groups.values():
            for pg in pgs:
                remove_placement_group(pg)
        available = {k: v for k, v in ray.available_resources().items() if not _is_internal(k)}
        raise PlacementError(
            f"Ray did not reserve the placement groups within cluster.placement_timeout_s="
            f"{_number(cfg.cluster.placement_timeout_s)} s. The plan fits the cluster's totals, so other jobs "
            f"probably hold the resources (free now: {_bundle_text(available)}).\n{describe(plan, nodes, None)}\n"
            "Fix: wait for them, raise cluster.placement_timeout_s, or shrink the plan.") from None
    return Placement(plan, groups)
