"""cluster/waits.py: a driver's wait that runs out names what it waited for and the setting that bounds it."""

import time

import pytest
import ray

from cluster.waits import get_within

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=0)
def hangs(seconds: float) -> str:
    time.sleep(seconds)
    return "late"


def test_a_call_past_its_limit_names_the_call_and_the_setting(ray_cluster):
    assert get_within(hangs.remote(0.0), 30.0, "a quick call", "fault.call_timeout_s") == "late"
    with pytest.raises(TimeoutError, match=r"the controller's stats did not answer within "
                                           r"fault.call_timeout_s=0.2 s: .* raise fault.call_timeout_s"):
        get_within(hangs.remote(30.0), 0.2, "the controller's stats", "fault.call_timeout_s")
