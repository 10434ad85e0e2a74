"""The announcement of one published weight version: what learner rank 0's sender returns (weights/transport.py
`WeightSender.publish`), what the driver hands the controller, and what a rollout worker's receiver loads from.

The tensors travel beside it, by the backend's own means (the Ray object store, a collective broadcast); `refs` is
the backend's opaque part: what a receiver needs to stage the version, kept inside this record so Ray passes object
refs through unresolved. Pydantic only.
"""

from pydantic import BaseModel, ConfigDict, Field


class DeltaStats(BaseModel):
    """What a publish with weight_sync.delta sent (weights/delta.py): a full version (`base_version` None: the
    first one, or after a new weight group) or the changes since `base_version`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_version: int | None = None
    """The version the delta applies to; None: the version went in full."""
    payload_bytes: int = Field(0, ge=0)
    """Bytes of the delta payload, or of the full version."""
    changed_elements: int | None = None
    """Elements that differ from `base_version`; None for a full version."""
    elements: int | None = None
    """Elements in the model; None for a full version."""


class WeightAnnouncement(BaseModel):
    """One published version: its size, how long the publish took, and what a receiver stages it from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=0)
    """Policy version: 0 is the initial model; the learner increments it once per optimizer step."""
    num_tensors: int = Field(0, ge=0)
    num_bytes: int = Field(0, ge=0)
    """Bytes sent for this version (a delta's payload, plus a new keyframe when one was put)."""
    seconds: float = Field(0.0, ge=0)
    """Wall time of the publish on learner rank 0."""
    refs: list = Field(default_factory=list)
    """The backend's payload, opaque outside it: object_store's object refs (one, or a keyframe-and-deltas chain
    with weight_sync.delta); [] when the weights travel by other means (collective)."""
    delta: DeltaStats | None = None
    """With weight_sync.delta, what this publish sent; None when weight_sync is dense."""
