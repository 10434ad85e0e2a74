"""The driver's read of a batch: the queue hands over headers (protocols/group_header.py), and the tokens are
fetched here by ref, once, from the object stores of the nodes that made them.

The fetch is one `ray.get` over every group's ref and its scorers' rows. A group whose object cannot be fetched
(the node that held it died) is not trained: it is returned by id, and the controller counts it dropped
`group_lost` (`RolloutController.count_lost`), so the accounting still adds up.
"""

import logging

import ray

from protocols.group_header import GroupHeader
from protocols.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)

LOST = "group_lost"
"""The drop reason of a group whose tokens could not be fetched."""


def _refs(header: GroupHeader) -> list:
    return ([header.ref] if header.ref is not None else []) + (
        list(header.scores.values()) if header.ref is not None else [])


def _assemble(header: GroupHeader, values: list) -> TrajectoryGroup:
    if header.ref is None:
        return header.inline()
    group, rows = values[0], values[1:]
    return header.assemble(group, dict(zip(header.scores, rows)))


def fetch_groups(headers: list[GroupHeader], timeout_s: float) -> tuple[list[TrajectoryGroup], list[str]]:
    """(the groups assembled as the learner reads them, in order; the ids of those whose objects were lost)."""
    refs = [_refs(h) for h in headers]
    try:
        values = ray.get([ref for group in refs for ref in group], timeout=timeout_s)
    except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError):
        return _fetch_each(headers, refs, timeout_s)
    groups, start = [], 0
    for header, group_refs in zip(headers, refs):
        groups.append(_assemble(header, values[start:start + len(group_refs)]))
        start += len(group_refs)
    return groups, []


def _fetch_each(headers: list[GroupHeader], refs: list[list], timeout_s: float
                ) -> tuple[list[TrajectoryGroup], list[str]]:
    """The slow road after a lost object: group by group, keeping what can be read."""
    groups, lost = [], []
    for header, group_refs in zip(headers, refs):
        try:
            groups.append(_assemble(header, ray.get(group_refs, timeout=timeout_s)))
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as err:
            log.warning("group %s could not be fetched (%s): counted dropped %s", header.group_id,
                        type(err).__name__, LOST)
            lost.append(header.group_id)
    return groups, lost
