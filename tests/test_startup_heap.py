"""learner/startup_heap.py: the block runs without the cyclic collector, what existed by its end is frozen, and
the collector is left as it was found."""

import gc

from learner.startup_heap import frozen_after_imports


def test_the_block_runs_without_collection_and_its_objects_end_frozen():
    gc.enable()
    with frozen_after_imports():
        assert not gc.isenabled()
        made_inside = [[] for _ in range(1000)]  # tracked containers, as a module's are
        before = gc.get_freeze_count()
    # every object alive at the end is frozen, those 1000 lists (and the list holding them) among them
    assert gc.get_freeze_count() >= before + 1001 and gc.isenabled()
    assert len(made_inside) == 1000


def test_a_disabled_collector_stays_disabled_even_when_the_block_raises():
    gc.disable()
    try:
        try:
            with frozen_after_imports():
                raise ImportError("no such module")
        except ImportError:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
