"""A lost learner rank stops the run with an error that names the rank and its node.

DeepSpeed ranks cannot be swapped one at a time (the process group, the optimizer partitions), so a dead rank
ends the run; the last checkpoint written before it stays the one to resume from, because the driver writes
nothing after the error. Every call fanned out to the ranks is gathered here, within fault.learner_timeout_s.
"""

import time

import ray

PING_S = 5.0
"""How long a rank may take to answer the liveness ping sent after a failed call (a dead actor answers at once)."""


class LearnerRankLost(RuntimeError):
    """A learner (or critic) rank's actor died; the message names the rank, its node and what it was doing."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks
        """The dead ranks' indices (the critic's group restarts from them rather than stopping the run)."""


def _node_of(placement, rank: int, role: str = "learner") -> str:
    """'node <id> (<ip>)' of rank `rank`'s bundle of `role`, or 'an unknown node' when Ray no longer says."""
    try:
        node_id = placement.bundle_nodes(role)[rank]
        ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}
        return f"node {node_id} ({ips.get(node_id, 'address unknown')})"
    except (KeyError, IndexError, AttributeError, ray.exceptions.RayError):
        return "an unknown node"


def dead_ranks(ranks: list) -> list[int]:
    """Indices of the ranks whose actor is dead (a busy rank that does not answer in PING_S counts as alive)."""
    pings = [rank.ping.remote() for rank in ranks]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_S)
    dead = []
    for index, ref in enumerate(pings):
        if ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                dead.append(index)
    return dead


def _lost(ranks: list, placement, what: str, cause: BaseException | None,
          role: str = "learner") -> LearnerRankLost | None:
    dead = dead_ranks(ranks)
    if not dead:
        return None
    names = ", ".join(f"rank {r} on {_node_of(placement, r, role)}" for r in dead)
    return LearnerRankLost(
        f"{role} {names} died during {what}; the run stops (DeepSpeed ranks cannot be replaced one at a time). "
        f"Nothing was written after the failure: resume from the newest checkpoint under <output_dir>/checkpoints "
        f"(`relayrl train --resume RUN_DIR`). Cause: {type(cause).__name__ if cause else 'unknown'}: {cause}", dead)


def gather_ranks(refs: list, ranks: list, placement, what: str, timeout_s: float, role: str = "learner",
                 setting: str = "fault.learner_timeout_s") -> list:
    """ray.get of one call per rank (in rank order), waiting at most `timeout_s` (the value of `setting`, which a
    timeout names) in all. A failure is checked at once, not after the other ranks (they may sit in a collective
    with the dead one)."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            lost = _lost(ranks, placement, what, None, role)
            if lost is not None:
                raise lost
            raise TimeoutError(
                f"{what} did not finish on every {role} rank within {setting}={timeout_s}; raise it if such "
                "calls are this long, or look for a rank stuck in a collective")
        try:
            ray.get(ready[0])
        except ray.exceptions.RayError as err:
            lost = _lost(ranks, placement, what, err, role)
            if lost is not None:
                raise lost from err
            raise
    return ray.get(list(refs))
