"""Which weight transport `weight_sync.type` names: the one place in the code that reads it. The learner rank
builds its sender here, each rollout worker its receiver, and the driver asks whether the backend forms a group.

Adding a backend: a module learner/transport_<type>.py with a sender, a receiver and `BACKEND`; its config
literal in protocols/config.py (`WeightSyncConfig`); one entry below; its tests.
"""

from learner import transport_collective, transport_object_store
from learner.weight_transport import WeightBackend

BACKENDS: dict[str, WeightBackend] = {b.type: b for b in (transport_object_store.BACKEND,
                                                           transport_collective.BACKEND)}


def weight_backend(cfg) -> WeightBackend:
    """The backend of `cfg.weight_sync.type`."""
    name = cfg.weight_sync.type
    if name not in BACKENDS:
        raise ValueError(f"weight_sync.type={name!r} has no transport module; known: {', '.join(BACKENDS)}. Add "
                         "learner/transport_<type>.py and list its BACKEND in learner/weight_backends.py")
    return BACKENDS[name]
