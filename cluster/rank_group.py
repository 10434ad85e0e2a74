"""A group of DeepSpeed ranks hosted by Ray actors: started in their role's placement bundles, joined into one
process group, called together (a batch's shards by the one plan, learner/batch_plan.py) and waited for within
a fault.* limit. The policy's learner group (cluster/learner_group.py) and the critic's (cluster/critic_group.py)
each hold one and add only what is theirs: mini-batches and the weights out for the learner, values and restart
after a lost rank for the critic.
"""

import socket

import ray

from cluster.learner_failure import gather_ranks
from cluster.placement import Placement, with_env
from learner.batch_plan import BatchPlan
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch

RANK_ENV = {"TORCHDYNAMO_DISABLE": "1"}
"""Environment of every rank, on top of the job's. The ranks compile nothing, but DeepSpeed's ZeRO optimizers
import its Muon module, whose @torch.compile decorators load TorchInductor: about 1.5 s of a rank's start (of
about 10 s on a CPU), paid again by every rank of every group."""


def rendezvous_address(_rank0, all_on_one_node: bool) -> tuple[str, int]:
    """Runs inside rank 0's actor: a free port on its own node (a port free on the driver's node may be taken
    there), and its address, or loopback when every rank shares the node."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ("127.0.0.1" if all_on_one_node else ray.util.get_node_ip_address()), port


class RankGroup:
    def __init__(self, actor_class: type, role: str, cfg: RunConfig, model_path: str, options: list[dict],
                 setup_args: tuple = (), placement: Placement | None = None, start_timeout_s: float | None = None,
                 timeout_setting: str = "fault.worker_start_timeout_s", join: bool = True) -> None:
        """Start one actor of `actor_class` per entry of `options` (its Ray options), rank r as
        `actor_class(cfg, r, num_ranks, model_path)`, then join them (`join`; join=False leaves that to the
        caller, so that other actors can start while these do)."""
        self.role = role
        self.cfg = cfg
        self.placement = placement
        self.ranks = [ray.remote(actor_class).options(**with_env(opts, RANK_ENV))
                      .remote(cfg, r, len(options), model_path) for r, opts in enumerate(options)]
        self._join_args = (setup_args, start_timeout_s, timeout_setting)
        if join:
            self.join()

    def join(self) -> None:
        """Rank 0 picks the rendezvous port on its own node and every rank runs `setup(master, port, *setup_args)`
        together. Waits at most `start_timeout_s` (None: no limit), raising TimeoutError that names
        `timeout_setting`."""
        setup_args, start_timeout_s, timeout_setting = self._join_args
        one_node = self.placement is None or len(set(self.placement.bundle_nodes(self.role))) == 1
        try:
            # __ray_call__ runs the function inside rank 0's own process, so the port is free on rank 0's node.
            master, port = ray.get(self.ranks[0].__ray_call__.remote(rendezvous_address, one_node),
                                   timeout=start_timeout_s)
            ray.get([rank.setup.remote(master, port, *setup_args) for rank in self.ranks], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"the {self.role} ranks did not start within {timeout_setting}={start_timeout_s}; "
                               "raise it, or check that their placement bundles' resources were freed") from err

    def __len__(self) -> int:
        return len(self.ranks)

    def call(self, method: str, *args, **kwargs) -> list:
        """Refs of `method(*args, **kwargs)` on every rank, in rank order (collectives need every rank)."""
        return [getattr(rank, method).remote(*args, **kwargs) for rank in self.ranks]

    def call_each(self, method: str, per_rank: list[tuple[tuple, dict]]) -> list:
        """Refs of `method(*args, **kwargs)` on rank r with (args, kwargs) = per_rank[r]."""
        return [getattr(rank, method).remote(*args, **kwargs) for rank, (args, kwargs) in zip(self.ranks, per_rank)]

    def call_sharded(self, method: str, batch: TrainingBatch, plan: BatchPlan, *args, ranks_per_shard: int = 1) -> list:
        """Refs of `method(shard, *args, plan=micro-batches)` on every rank: rank r takes shard r // ranks_per_shard
        of `plan` with its micro-batches (the sequence-parallel ranks of a group share one)."""
        shards = [batch.select(idx) for idx in plan.shards]
        return self.call_each(method, [((shards[r // ranks_per_shard], *args),
                                        {"plan": plan.micro_batches[r // ranks_per_shard]})
                                       for r in range(len(self.ranks))])

    def gather(self, refs: list, what: str, limit: str = "learner_timeout_s") -> list:
        """Results of one call per rank within fault.<limit> (a call's own limit: a step, a save), which a timeout
        names; a dead rank raises LearnerRankLost naming the rank and its node (cluster/learner_failure.py)."""
        return gather_ranks(refs, self.ranks, self.placement, what, getattr(self.cfg.fault, limit), role=self.role,
                            setting=f"fault.{limit}")

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
