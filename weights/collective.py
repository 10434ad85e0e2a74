"""The `collective` weight transport: learner rank 0 and every rollout engine join one torch.distributed group of
their own (gloo on CPU, NCCL on GPUs; never DeepSpeed's default group), and rank 0 broadcasts each version in
byte buckets (protocols/weight_wire.py's `BucketLayout`), announced by a header on the group's TCPStore.

The receiver keeps a thread always ready for the next broadcast: it waits for the announcement on the store,
then joins the broadcast of the buckets into staging buffers, whatever the worker's loop is doing. So the learner
broadcasts whenever it likes, and the engine still changes weights only between decode steps. The staging buffers
cost one model copy per engine; a newer version that arrives before the loop loads the previous one replaces it
(the worker wants the newest anyway). The loop and the thread share the buffers under a lock. Torch only.

With weight_sync.delta the staging buffers are the engine's held copy: every member receives every broadcast, so
each applies every delta to its buffers in turn (a version the loop skips is still applied). A group's first
broadcast is a full version: joining (the start, or the rejoin of every member after an engine was replaced)
resets the sender's copy, so a new engine never needs a delta it cannot apply. The delta travels as one byte
payload in `bucket_mb` pieces, received into a buffer apart from the staging buffers (an engine loading the
last version does not hold the broadcast up), then applied under the lock.
"""

import logging
import threading
import time
from datetime import timedelta
from typing import Iterator

import torch

from protocols.weight_announcement import WeightAnnouncement
from protocols.weight_wire import (ALTERNATIVE, BucketLayout, check_header, delta_of, header_bytes,
                                   header_from_bytes, metas_from_rows)
from weights.transport import (BroadcastFailed, NamedTensors, WeightBackend, WeightReceiver, WeightSender,
                               apply_delta)

log = logging.getLogger(__name__)
POLL_S = 0.01  # latency added to a version's arrival, at most


def group_info(cfg, host: str, port: int, world_size: int, metas: list) -> dict:
    """What every member joins with (each engine adds its own `rank`): the store's address, the process-group
    backend (`auto`: nccl when the learner is on GPUs, else gloo), the bucket size and the tensor metas."""
    ws = cfg.weight_sync
    backend = ws.backend if ws.backend != "auto" else ("nccl" if cfg.cluster.use_gpus else "gloo")
    return {"host": host, "port": port, "world_size": world_size, "backend": backend, "timeout_s": ws.timeout_s,
            "bucket_bytes": ws.bucket_mb * 2**20, "metas": metas}


def header_key(seq: int) -> str:
    """The store key announcing the `seq`-th broadcast (1, 2, ...). The announcement travels through the store,
    not the group: a receiver may wait for the next version for as long as the learner trains, and a collective
    left pending that long would hit the group's timeout (and on NCCL hold a kernel on the GPU)."""
    return f"header/{seq}"


def open_weight_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                      device: torch.device | None = None):
    """(group, store): a standalone ProcessGroup on a TCPStore at host:port (rank 0 serves the store). It is not
    registered as torch.distributed's default group, so it never mixes with DeepSpeed's collectives.

    Raises RuntimeError naming `weight_sync` settings when the store cannot be reached or bound (port in use)
    or the peers do not all arrive within `timeout_s`.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout,
                              wait_for_workers=True)
        store = dist.PrefixStore("relayrl_weights", store)
        if backend == "gloo":
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            if device is not None:
                # NCCL builds its communicator lazily; one tiny collective now surfaces join errors here.
                group.broadcast(torch.zeros(1, device=device), 0).wait()
        else:
            raise ValueError(f"weight_sync.backend={backend!r}; allowed: gloo, nccl")
    except (RuntimeError, ValueError, OSError) as err:
        raise RuntimeError(
            f"weight_sync.type=collective: rank {rank} of {world_size} could not join the weight group at "
            f"{host}:{port} (backend {backend}) within weight_sync.timeout_s={timeout_s}: {err}. Check that "
            f"every rollout engine started and the port is free and reachable, raise weight_sync.timeout_s, "
            f"or use {ALTERNATIVE}") from err
    return group, store


def _group_device(info: dict, device: torch.device) -> torch.device:
    # gloo moves host tensors; NCCL moves tensors on this process's GPU
    return device if info["backend"] == "nccl" else torch.device("cpu")


class CollectiveSender(WeightSender):
    """Broadcasts weights from group rank 0 in byte buckets, each announced on the group's store first (a header:
    protocol, version, tensor count, layout checksum).

    Buckets live on the parameters' device, so on GPUs a parameter is copied device-to-device into a bucket and
    NCCL sends it: no host copy. Two buckets alternate so filling one overlaps the broadcast of the other.
    """

    type = "collective"

    def __init__(self, cfg, on_gpu: bool) -> None:
        super().__init__(cfg, on_gpu)
        self.group = None  # set by join
        self.store = None
        self.seq = 0

    def join(self, info: dict, device: torch.device) -> None:
        device = _group_device(info, device)
        self.group, self.store = open_weight_group(info["host"], info["port"], 0, info["world_size"],
                                                   info["backend"], info["timeout_s"], device)
        self.seq = 0
        self.reset_delta()  # the members of a new group may hold any version: its first broadcast is full
        self.layout = BucketLayout(metas_from_rows(info["metas"]), info["bucket_bytes"])
        self.device = device
        self.timeout_s = info["timeout_s"]
        self._flats = [torch.empty(max(self.layout.bucket_sizes), dtype=torch.uint8, device=device)
                       for _ in range(min(2, len(self.layout.buckets)))]

    def _broadcast(self, tensor: torch.Tensor):
        return self.group.broadcast(tensor, 0)

    def send(self, weights: NamedTensors, version: int) -> WeightAnnouncement:
        """Broadcast one version. `weights` yields tensors in the layout's order (checked)."""
        if self.group is None:
            raise RuntimeError("weight_sync.type=collective but the learner has not joined the weight group; "
                               "the trainer calls LearnerGroup.join_weight_group after starting the workers")
        self.seq += 1
        self.store.set(header_key(self.seq), header_bytes(self.layout.header(version)))
        it = iter(weights)
        try:
            self._send_buckets(it)
        except BroadcastFailed:
            # The other learner ranks sit in this iterator's ZeRO-3 gathers: finish them, so a retry on a new group
            # (cluster/supervisor.py) starts all ranks at the first gather together.
            for _ in it:
                pass
            raise
        for _ in it:  # let a layer-by-layer gather finish its collectives
            pass
        return WeightAnnouncement(version=version, num_tensors=len(self.layout.metas), num_bytes=self.layout.num_bytes)

    def send_delta(self, payload: torch.Tensor, version: int, base: int) -> WeightAnnouncement:
        """Broadcast one delta payload (host bytes; copied to the group's device first) in bucket-size pieces."""
        if self.group is None:
            raise RuntimeError("weight_sync.type=collective but the learner has not joined the weight group; "
                               "the trainer calls LearnerGroup.join_weight_group after starting the workers")
        self.seq += 1
        size = payload.numel()
        self.store.set(header_key(self.seq), header_bytes(self.layout.header(version, base, size)))
        data = payload.to(self.device)
        step = self.layout.bucket_bytes
        for start in range(0, size, step):
            try:
                work = self._broadcast(data[start: start + step])
            except RuntimeError as err:
                raise self._failed(f"delta bytes {start}..", err) from err
            self._wait(work, f"delta bytes {start}..")
        return WeightAnnouncement(version=version, num_tensors=len(self.layout.metas), num_bytes=size)

    def _send_buckets(self, it: Iterator[tuple[str, torch.Tensor]]) -> None:
        pending = [None] * len(self._flats)
        for b, entries in enumerate(self.layout.buckets):
            slot = b % len(self._flats)
            if pending[slot] is not None:
                self._wait(pending[slot], f"bucket {b - len(self._flats)}")
            flat = self._flats[slot]
            for i, offset in entries:
                meta = self.layout.metas[i]
                name, tensor = next(it)
                if name != meta.name or tuple(tensor.shape) != meta.shape:
                    raise ValueError(f"weight {i} is {name} {tuple(tensor.shape)} but the layout the engines "
                                     f"joined with says {meta.name} {meta.shape}; rejoin the weight group after a "
                                     "model change")
                flat[offset: offset + meta.num_bytes].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            size = self.layout.bucket_sizes[b]
            try:
                pending[slot] = self._broadcast(flat[:size])
            except RuntimeError as err:  # gloo may refuse at once a pair whose peer already closed it
                raise self._failed(f"bucket {b}", err) from err
        for work in pending:
            if work is not None:
                self._wait(work, "last buckets")

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            raise self._failed(what, err) from err

    def _failed(self, what: str, err: BaseException) -> BroadcastFailed:
        return BroadcastFailed(
            f"weight_sync.type=collective: broadcast of the {what} failed or passed weight_sync.timeout_s="
            f"{self.timeout_s}: {err}. A rollout engine left the weight group or stopped receiving; "
            "weight_sync.type=object_store needs no group")


class _Membership:
    """One engine's membership of one weight group: the group, the staging buffers and the receiver thread. A
    rejoin makes a new one, so a thread of the old group never touches the new group's buffers."""

    def __init__(self, info: dict, device: torch.device) -> None:
        self.layout = BucketLayout(metas_from_rows(info["metas"]), info["bucket_bytes"])
        self.timeout_s = info["timeout_s"]
        self.group, self.store = open_weight_group(info["host"], info["port"], info["rank"], info["world_size"],
                                                   info["backend"], self.timeout_s, device)
        self._flats = [torch.empty(size, dtype=torch.uint8, device=device) for size in self.layout.bucket_sizes]
        self._views = [pair for b, flat in enumerate(self._flats) for pair in self.layout.views(b, flat)]
        self._delta = torch.empty(0, dtype=torch.uint8, device=device)  # grows to the largest delta received
        self._seq = 0
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self.staged_version = 0
        self.error: BaseException | None = None
        self.receive_seconds: list[float] = []
        self._closed = False
        self._thread = threading.Thread(target=self._receive_loop, name="weight-receiver", daemon=True)
        self._thread.start()

    def _receive_loop(self) -> None:
        try:
            while not self._closed:
                # The wait for the next version may last as long as the learner trains, so it polls the store
                # (one small request per interval) rather than sitting in a collective or a store wait, whose
                # timeouts would fire (and log a warning each time) during a long step.
                key = header_key(self._seq + 1)
                if not self.store.check([key]):
                    time.sleep(POLL_S)
                    continue
                self._seq += 1
                header = header_from_bytes(self.store.get(key))
                version = check_header(header, self.layout)
                base, delta_bytes = delta_of(header)
                start = time.perf_counter()
                if base >= 0:
                    self._receive_delta(version, base, delta_bytes, start)
                    continue
                with self._lock:
                    # The learner sends the buckets right after the header; the loop waits at most one receive.
                    for flat in self._flats:
                        self.group.broadcast(flat, 0).wait()
                    self.staged_version = version
                    self.receive_seconds.append(time.perf_counter() - start)
                    self._arrived.notify_all()
        except BaseException as err:  # handed to the loop thread, which raises it with context
            if not self._closed:
                log.error("weight receiver stopped: %s", err)
                with self._lock:
                    self.error = err
                    self._arrived.notify_all()

    def _receive_delta(self, version: int, base: int, size: int, start: float) -> None:
        if self._delta.numel() < size:
            self._delta = torch.empty(size, dtype=torch.uint8, device=self._delta.device)
        step = self.layout.bucket_bytes
        for offset in range(0, size, step):
            self.group.broadcast(self._delta[offset: min(offset + step, size)], 0).wait()
        with self._lock:
            if self.staged_version != base:
                raise RuntimeError(f"weight_sync.delta: the learner sent version {version} as changes to version "
                                   f"{base}, but this engine holds version {self.staged_version}; the group's "
                                   "first broadcast must be full (rejoin the group, or set weight_sync.delta=false)")
            apply_delta(self._views, self._delta[:size])
            self.staged_version = version
            self.receive_seconds.append(time.perf_counter() - start)
            self._arrived.notify_all()

    def stage(self, version: int) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        deadline = time.monotonic() + self.timeout_s
        self._lock.acquire()
        while self.staged_version < version and self.error is None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._lock.release()
                raise RuntimeError(
                    f"weight_sync.type=collective: version {version} was announced but not received within "
                    f"weight_sync.timeout_s={self.timeout_s} (staged: {self.staged_version}); {ALTERNATIVE}")
            self._arrived.wait(left)
        if self.error is not None:
            self._lock.release()
            raise RuntimeError(f"weight_sync.type=collective: the receiver thread failed: {self.error}; "
                               f"{ALTERNATIVE}") from self.error
        return self.staged_version, list(self._views)

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._closed = True


class CollectiveReceiver(WeightReceiver):
    type = "collective"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.membership: _Membership | None = None

    def join(self, info: dict) -> None:
        """Join as rank `info["rank"]` (every member calls this at the same time) and start the receiver thread.
        A rejoin after an engine was replaced ends the old group's thread first."""
        self.close()
        device = _group_device(info, torch.device("cuda"))
        self.membership = _Membership(info, device)

    def stage(self, announcement: WeightAnnouncement) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """(staged version, views of the staged weights) once the announced version or a newer one has arrived
        (the announcement's refs are empty: the weights came by broadcast). Holds the staging lock until
        `release()`, so the receiver thread cannot overwrite them while the engine loads."""
        version = announcement.version
        if self.membership is None:
            raise RuntimeError(f"weight_sync.type=collective: version {version} was announced but this worker has "
                               "not joined the weight group; LearnerGroup.join_weight_group joins every engine")
        return self.membership.stage(version)

    def release(self) -> None:
        self.membership.release()

    def close(self) -> None:
        if self.membership is not None:
            self.membership.close()


BACKEND = WeightBackend("collective", CollectiveSender, CollectiveReceiver, group_info=group_info)
