"""Bounded waits on Ray calls: every `ray.get` of the driver's has a limit, and the error names the call, the
setting that bounds it and what to do. Ray's own GetTimeoutError says neither."""

import ray


def get_within(refs, timeout_s: float, what: str, setting: str):
    """`ray.get(refs)` within `timeout_s` seconds; past it a TimeoutError naming `what` was awaited and the
    `setting` (a `fault.*` name) that bounds it."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        raise TimeoutError(
            f"{what} did not answer within {setting}={timeout_s:g} s: the actor is stuck or its node is overloaded. "
            f"Look at its log (`ray logs`, RUN_DIR), or raise {setting} if it only needs longer") from err
