"""The weight-transport interface: how learner rank 0's weights reach the rollout engines, whatever the backend.

Each backend is one module in weights/ holding a `WeightSender` (learner rank 0, learner/rank_weights.py) and a
`WeightReceiver` (each rollout worker, actors/rollout_worker.py); both speak the wire format of
protocols/weight_wire.py. weights/backends.py lists the backends and picks one from the config, the one place that
reads `weight_sync.type`. One version's path:

    sender.publish(weights, version) -> WeightAnnouncement (protocols/weight_announcement.py)
    -> driver -> controller -> receiver.load(announcement, apply) on each worker, between two decode steps

`publish` and `load` are the one place a version is encoded and decoded for every backend: a check or an
encoding shared by all backends belongs there, not in a backend. Delta sync (`weight_sync.delta`) is one: `publish`
keeps the host copy of the last version (weights/delta.py `PreviousWeights`) and hands a backend either the
full weights (`send`: the first version, or after `reset_delta`) or the encoded changes (`send_delta`); a receiver
applies a delta to the copy it holds with `apply_delta`. What each backend does for an engine that is behind or
new (a full version) is in its module. Torch only at load: Ray is imported inside the methods that use it.
"""

import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

import torch

from protocols.weight_announcement import DeltaStats, WeightAnnouncement
from weights.delta import PreviousWeights, apply_delta  # noqa: F401 (receivers apply deltas with it)

NamedTensors = Iterator[tuple[str, torch.Tensor]]
"""(name, tensor) pairs in checkpoint (HF) format, in the fixed order of LearnerRank.weight_metas."""


class BroadcastFailed(RuntimeError):
    """A publish failed because a member of the weight group is gone (a dead rollout engine closes its
    connections) or passed weight_sync.timeout_s. The group is unusable afterwards; the supervisor replaces the
    dead engine, opens a new group and sends again (cluster/supervisor.py publish_weights)."""


class WeightSender(ABC):
    """Learner rank 0's side of one backend. Built once per rank with the run's config and whether the weights
    live on a GPU."""

    type: ClassVar[str]

    def __init__(self, cfg, on_gpu: bool) -> None:
        self.cfg = cfg
        self.on_gpu = on_gpu
        self.previous = PreviousWeights() if cfg is not None and getattr(cfg.weight_sync, "delta", False) else None
        """weight_sync.delta: the last version sent, as one copy in host memory (never on the GPU); None: dense."""

    def join(self, info: dict, device: torch.device) -> None:
        """Join the weight group described by `info` (WeightBackend.group_info) as its rank 0, on this rank's
        `device`. Only backends that form a group implement it."""
        raise RuntimeError(f"weight_sync.type={self.type} forms no weight group; nothing joins it")

    def publish(self, weights: NamedTensors, version: int) -> WeightAnnouncement:
        """Send `weights` as `version`; returns the announcement the driver hands to the controller (its refs:
        what a receiver needs to stage it; [] when it travels by other means). The iterator is run to its end
        even on failure: under ZeRO-3 the other ranks wait in its gathers."""
        start = time.perf_counter()
        if self.previous is None:
            announcement = self.send(weights, version)
        else:
            announcement = self._publish_delta(iter(weights), version)
        return announcement.model_copy(update={"seconds": time.perf_counter() - start})

    def _publish_delta(self, weights: NamedTensors, version: int) -> WeightAnnouncement:
        """A full version when there is nothing to encode against (the first, or after `reset_delta`), recorded
        into the host copy as it is sent; else the changes since the copy's version. Any failure drops the copy,
        so the next publish is full again (a half-updated copy would make every later delta wrong)."""
        previous, base = self.previous, self.previous.version
        try:
            if base is None:
                announcement = self.send(previous.record(weights, version), version)
                stats = DeltaStats(base_version=None, payload_bytes=announcement.num_bytes)
            else:
                payload = previous.encode(weights, version)
                announcement = self.send_delta(payload, version, base)
                stats = DeltaStats(base_version=base, **{k: v for k, v in previous.last_stats.items() if k != "kinds"})
        except BaseException:
            previous.reset()
            for _ in weights:  # under ZeRO-3 the other ranks wait in this iterator's gathers
                pass
            raise
        return announcement.model_copy(update={"delta": stats})

    def reset_delta(self) -> None:
        """The receivers may not hold the last version (a new group): the next publish goes in full."""
        if self.previous is not None:
            self.previous.reset()

    def send_delta(self, payload: torch.Tensor, version: int, base: int) -> WeightAnnouncement:
        """Transfer the delta `payload` (flat uint8, host memory) that turns `base` into `version`; returns its
        announcement (version, refs, num_tensors, num_bytes). Every backend implements it."""
        raise NotImplementedError(f"weight_sync.type={self.type} has no delta path; set weight_sync.delta=false")

    @abstractmethod
    def send(self, weights: NamedTensors, version: int) -> WeightAnnouncement:
        """The backend's encoding and transfer of one version: returns its announcement (version, refs,
        num_tensors, num_bytes); `publish` adds the time taken and the delta stats."""


class WeightReceiver(ABC):
    """A rollout worker's side of one backend. Built once per worker with the run's config; a backend that forms
    a group is joined (and re-joined after a replacement) through `join`."""

    type: ClassVar[str]

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def join(self, info: dict) -> None:
        """Join the weight group described by `info` as rank `info["rank"]`, leaving any earlier group. Only
        backends that form a group implement it."""
        raise RuntimeError(f"weight_sync.type={self.type} forms no weight group; nothing joins it")

    def load(self, announcement: WeightAnnouncement,
             apply: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Stage the announced version, hand its checkpoint-format pairs to `apply` (the engine's in-place load),
        release them. Returns the version applied: the announced one, or a newer one that has already arrived. With
        weight_sync.delta the backend applies the deltas to the full copy it holds and the engine loads that copy
        whole (the engine's own weights are fused and repacked: a delta cannot be applied to them in place)."""
        loaded, weights = self.stage(announcement)
        try:
            apply(weights)
        finally:
            self.release()
        return loaded

    def direct_refs(self, announcement: WeightAnnouncement) -> list | None:
        """Object refs of the announced version in the object-store packed form (weights/object_store.py), when
        the engine's workers can read it themselves (each tensor-parallel worker maps it: no copy in this
        process); None when the backend stages the version here (`load`)."""
        return None

    @abstractmethod
    def stage(self, announcement: WeightAnnouncement) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """(version, checkpoint-format pairs) of the announced version or a newer one, from what the announcement
        carries (its refs, for a backend that puts the weights somewhere). The pairs stay valid until
        `release()`."""

    def release(self) -> None:
        """The engine has copied the staged pairs; the backend may reuse their memory."""

    def close(self) -> None:
        """Stop receiving (the worker is leaving or re-joining a group)."""


@dataclass(frozen=True)
class WeightBackend:
    """One `weight_sync.type`: its sender and receiver, and how its group is described when it forms one."""

    type: str
    sender: type[WeightSender]
    receiver: type[WeightReceiver]
    group_info: Callable[..., dict] | None = None
    """For a backend whose members (learner rank 0 and one receiver per engine) form one group of fixed
    membership: group_info(cfg, host, port, world_size, metas) -> the dict every member joins with. The group is
    opened once every engine has started (LearnerGroup.join_weight_group) and opened anew by every member after
    an engine is replaced, which then gets the newest version sent again (cluster/supervisor.py). None: no group,
    a new engine just loads the newest announcement."""

    @property
    def forms_group(self) -> bool:
        return self.group_info is not None


def group_address() -> tuple[str, int]:
    """This node's address as Ray's other nodes reach it, and a free port on it: where a weight group's rank 0
    serves the group's store. Ray is imported here, not at load, so the learner's modules load without it."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port
