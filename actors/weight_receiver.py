"""The receiving side of weight transport, used by a rollout worker: it turns an announced version into
checkpoint-format (name, tensor) pairs that the worker loads into its engine at a safe point.

`object_store`: the announcement carries an object ref; `fetch` maps it (zero-copy on the node).
`collective`: a receiver thread is always ready for the next broadcast and receives each version into
staging buffers as soon as the learner sends it, whatever the worker's loop is doing (it waits for the
learner's announcement on the group's store, then joins the broadcast of the buckets); `fetch` hands out the
staged tensors once the announced version has arrived. So the learner broadcasts whenever it likes (every
receiver is always waiting), and the engine still changes weights only between decode steps. The staging
buffers cost one model copy per engine; a newer version that arrives before the loop loads the previous one
replaces it (the worker wants the newest anyway). The loop and the thread share the buffers under a lock.
"""

import logging
import threading
import time

import torch

from learner.weight_wire import ALTERNATIVE, BucketLayout, WeightMeta, check_header, header_from_bytes, header_key
from learner.weight_wire import open_weight_group
from learner.weight_wire import unpack_state_dict

log = logging.getLogger(__name__)
POLL_S = 0.01  # latency added to a version's arrival, at most


class ObjectStoreReceiver:
    type = "object_store"

    def fetch(self, version: int, refs: list) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """(version, checkpoint-format pairs) of the announced weights; the pairs map the object store."""
        import ray

        if not refs:
            raise RuntimeError(f"weight version {version} was announced without an object ref; the learner and "
                               "this worker disagree on weight_sync.type")
        return version, unpack_state_dict(ray.get(refs[0]))

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class CollectiveReceiver:
    type = "collective"

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                 metas: list[WeightMeta], bucket_bytes: int, device: torch.device) -> None:
        self.layout = BucketLayout(metas, bucket_bytes)
        self.timeout_s = timeout_s
        self.device = device
        self.group, self.store = open_weight_group(host, port, rank, world_size, backend, timeout_s, device)
        self._flats = [torch.empty(size, dtype=torch.uint8, device=device) for size in self.layout.bucket_sizes]
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
                version = check_header(header_from_bytes(self.store.get(key)), self.layout)
                start = time.perf_counter()
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

    def fetch(self, version: int, refs: list) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """(staged version, views of the staged weights) once `version` or a newer one has arrived. Holds the
        staging lock until `release()`, so the receiver thread cannot overwrite them while the engine loads."""
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
        return self.staged_version, [pair for b, flat in enumerate(self._flats) for pair in self.layout.views(b, flat)]

    def release(self) -> None:
        self._lock.release()

    def close(self) -> None:
        self._closed = True
