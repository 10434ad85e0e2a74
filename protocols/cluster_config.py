"""The `cluster:` section of the run config: where the job's Ray cluster is (embedded or joined), what each role's
actors reserve on it, and whether it may grow (protocols/config.py assembles the sections)."""

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocols.model_workers import RAY_BUILTIN_RESOURCES


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = ""
    """Ray cluster to join (`auto` or `ray://host:port`). Empty starts an embedded local cluster."""

    num_cpus: int = Field(0, ge=0)
    """Logical CPUs of the embedded cluster; 0 means the machine's count. Actors take fractions of them."""

    dashboard_host: str = "127.0.0.1"
    """Where the Ray dashboard binds when `include_dashboard` is set; keep it on loopback unless you need it."""

    include_dashboard: bool = False
    """Start Ray's dashboard with the embedded cluster (costs memory and start time)."""

    use_gpus: bool = False
    """Give each learner rank one GPU and each vLLM engine rollout.tensor_parallel_size GPUs. False runs
    everything on CPU (the bundles then ask only for CPUs)."""

    learner_cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs reserved per learner rank (its placement bundle, beside its GPU). Fractions are allowed."""

    rollout_cpus: float = Field(1.0, gt=0, le=1024)
    """CPUs reserved per rollout engine (its bundle, beside rollout.tensor_parallel_size GPUs)."""

    reward_cpus: float = Field(0.5, gt=0, le=1024)
    """CPUs reserved per reward worker. Its reward.num_processes verifier processes run within them; raise it
    when verifiers are heavy (code execution) so the reservation matches what they use."""

    learner_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each learner rank's bundle asks for, to pin the learner to chosen nodes, e.g.
    `{learner_node: 1}` with the node started by `ray start --resources '{"learner_node": 8}'`. Asked per
    rank: a node needs learner.num_ranks units to hold every rank."""

    rollout_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each rollout engine's bundle asks for (per engine), e.g. `{rollout_node: 1}`."""

    reward_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each reward worker's bundle asks for (per worker)."""

    placement_timeout_s: float = Field(300.0, gt=0, le=86_400)
    """Seconds to wait for Ray to reserve the placement groups. A plan that exceeds the cluster's totals is
    refused at once; this bounds the wait when other jobs hold the resources or an autoscaler adds nodes."""

    autoscaling: bool = False
    """The cluster adds nodes on demand (Ray's autoscaler: KubeRay with enableInTreeAutoscaling, the Ray cluster
    launcher). A rollout resize past what the nodes hold then asks Ray for the missing workers' resources
    (`ray.autoscaler.sdk.request_resources`) and waits for them within fault.worker_start_timeout_s; off, such a
    resize is refused at once, naming what the cluster has."""

    @field_validator("learner_resources", "rollout_resources", "reward_resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float], info) -> dict[str, float]:
        for name, amount in value.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(
                    f"cluster.{info.field_name} names the built-in resource {name!r}; set CPUs with "
                    "cluster.learner_cpus / rollout_cpus / reward_cpus and GPUs with cluster.use_gpus and "
                    "rollout.tensor_parallel_size; custom resources are the names given to `ray start --resources`")
            if not amount > 0:
                raise ValueError(f"cluster.{info.field_name}.{name}={amount} must be > 0")
        return value
