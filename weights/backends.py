"""Which weight transport `weight_sync.type` names: the list of backends, and the one place in the code that reads
the setting. The learner rank builds its sender here, each rollout worker its receiver, and the driver asks whether
the backend forms a group.

Adding a backend is one module (what it carries is the learner's choice: the full weights, or with model.lora the
adapter alone, weights/lora.py; a backend moves whatever (name, tensor) pairs it is given):
  1. weights/<type>.py with a `WeightSender` (`send`, `send_delta`), a `WeightReceiver` (`stage`; `join` when the
     backend forms a group) and `BACKEND = WeightBackend("<type>", Sender, Receiver, group_info=...)`
     (weights/transport.py). Import Ray or anything heavy inside the methods: the learner loads this package.
     Whatever a receiver needs to stage a version goes in the announcement's `refs`, which nothing else reads.
  2. its settings in protocols/weight_sync.py (a `SyncCheck` subclass with `type: Literal["<type>"]`, added to
     the `WeightSyncConfig` union) and its entry in `BACKENDS` below;
  3. its tests (tests/test_weight_transport.py checks that every backend here has both sides).
"""

from weights import collective, object_store
from weights.transport import WeightBackend

BACKENDS: dict[str, WeightBackend] = {b.type: b for b in (object_store.BACKEND, collective.BACKEND)}


def weight_backend(cfg) -> WeightBackend:
    """The backend of `cfg.weight_sync.type`."""
    name = cfg.weight_sync.type
    if name not in BACKENDS:
        raise ValueError(f"weight_sync.type={name!r} has no transport module; known: {', '.join(BACKENDS)}. Add "
                         "weights/<type>.py and list its BACKEND in weights/backends.py")
    return BACKENDS[name]
