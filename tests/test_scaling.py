"""cluster/scaling.py: between two steps the driver advances one resize at a time without waiting; a request made
during a resize waits in the run folder, the autoscaler holds, and each result says how many steps trained
meanwhile. The pool here keeps RolloutPool's begin/finish contract with no engines (the real pool's resizes run
in tests/test_multinode.py, tests/test_reference_workers.py and tests/test_metrics.py)."""

from contextlib import contextmanager

from cluster.placement import Node
from cluster.scale_requests import DriverHeartbeat, ScaleInbox, request_scale, wait_done
from cluster.scaling import Scaling
from protocols.config import load_config


class SlowPool:
    """RolloutPool's resize contract: `begin_grow` / `begin_drain` return at once; `finish_*` returns None until the
    resize has been polled `polls` times (an engine starting, groups draining), then its seconds."""

    def __init__(self, size: int, polls: int) -> None:
        self.workers = [object() for _ in range(size)]
        self.polls = polls
        self.joining = self.leaving = None

    def begin_grow(self, n: int) -> None:
        assert self.joining is None and self.leaving is None and n > len(self.workers)
        self.joining = {"target": n, "polls": 0}

    def begin_drain(self, n: int, timeout_s: float) -> None:
        assert self.joining is None and self.leaving is None and n < len(self.workers)
        del self.workers[n:]  # leaving workers are out of the pool at once: no new prompts
        self.leaving = {"target": n, "polls": 0}

    def finish_grow(self, wait: bool = False) -> float | None:
        self.joining["polls"] += 1
        if self.joining["polls"] < self.polls and not wait:
            return None
        self.workers += [object() for _ in range(self.joining["target"] - len(self.workers))]
        self.joining = None
        return 1.0

    def finish_drain(self, wait: bool = False) -> float | None:
        self.leaving["polls"] += 1
        if self.leaving["polls"] < self.polls and not wait:
            return None
        self.leaving = None
        return 1.0


def _scaling(pool: SlowPool, *overrides: str) -> Scaling:
    cfg = load_config(None, list(overrides))
    scaling = Scaling(cfg, {"rollout": pool}, queue_stats=lambda: {"queue/depth": 0, "queue/dropped_stale": 0})
    scaling.nodes = lambda: [Node("local", {"CPU": 64.0})]  # room for every size these tests ask for
    return scaling


@contextmanager
def running(run_dir):
    """A run folder whose driver beats (as Trainer.run's does), and the driver's inbox."""
    (run_dir / "config.yaml").write_text("{}\n")
    with DriverHeartbeat(run_dir):
        yield ScaleInbox(run_dir)


def test_a_grow_finishes_steps_later_and_a_request_made_meanwhile_waits_for_it(tmp_path):
    pool = SlowPool(1, polls=3)
    scaling = _scaling(pool)
    with running(tmp_path) as inbox:
        request_scale(tmp_path, 3)
        scaling.after_step({}, version=5, inbox=inbox)  # the grow starts; the driver goes on
        assert pool.joining is not None and len(pool.workers) == 1
        request_scale(tmp_path, 2)  # asked during the grow: it waits in the folder
        scaling.after_step({}, version=6, inbox=inbox)  # poll 1 of 3
        scaling.after_step({}, version=7, inbox=inbox)  # poll 2 of 3
        assert wait_done(tmp_path, 1, timeout_s=0) is None and len(pool.workers) == 1
        # poll 3: the engines serve, 3 workers; request 1's result says 8 - 5 = 3 steps trained meanwhile; then
        # request 2 (a shrink) starts at once: its workers leave the pool now and drain
        scaling.after_step({}, version=8, inbox=inbox)
        assert len(pool.workers) == 2 and pool.leaving is not None
        done = wait_done(tmp_path, 1, timeout_s=0)
        # (wait_done returns the newest result at or past id 1, request 1's until the shrink ends)
        assert (done["id"], done["rollout"], done["steps_while_resizing"]) == (1, 3, 3)
        scaling.settle(inbox, version=9)  # the run's end waits for the drain
        done = wait_done(tmp_path, 2, timeout_s=0)
        assert (done["id"], done["rollout"], done["steps_while_resizing"]) == (2, 2, 1) and pool.leaving is None


def test_the_autoscaler_holds_while_its_grow_is_under_way_and_decides_again_once_it_ends(tmp_path):
    pool = SlowPool(1, polls=2)
    scaling = _scaling(pool, "rollout.autoscale.enabled=true", "rollout.autoscale.max_workers=3",
                       "rollout.autoscale.patience_steps=1", "rollout.autoscale.cooldown_steps=0")
    inbox = ScaleInbox(tmp_path)
    waiting = {"time/wait_s": 0.9, "time/step_s": 1.0}  # the learner waited 90% of the step: grow
    first = scaling.after_step(waiting, version=1, inbox=inbox)
    # the decision: +1, asked for 2; 1 serves until the new engine does
    assert first["autoscale/reason_grow_waiting"] == 1.0
    assert (first["autoscale/change"], first["autoscale/size"], first["autoscale/target"]) == (1.0, 1.0, 2.0)
    held = scaling.after_step(waiting, version=2, inbox=inbox)  # poll 1 of 2: still starting
    assert held["autoscale/reason_hold_resizing"] == 1.0 and held["autoscale/change"] == 0.0
    assert (held["autoscale/size"], held["autoscale/target"]) == (1.0, 2.0)
    # poll 2: the engine joins (2 serve); the learner still waits, so the autoscaler asks for a third
    third = scaling.after_step(waiting, version=3, inbox=inbox)
    assert third["autoscale/reason_grow_waiting"] == 1.0
    assert (third["autoscale/size"], third["autoscale/target"]) == (2.0, 3.0)


def test_a_refused_request_is_answered_and_leaves_the_pool_settled(tmp_path):
    pool = SlowPool(2, polls=1)
    scaling = _scaling(pool)
    with running(tmp_path) as inbox:
        (tmp_path / "control" / "scale_request.json").write_text('{"id": 1, "rollout": 0}')  # hand-written
        scaling.after_step({}, version=1, inbox=inbox)
    done = wait_done(tmp_path, 1, timeout_s=0)
    assert done["rollout"] == 2 and "at least one rollout worker" in done["error"]
    assert scaling.under_way is None and pool.joining is None and pool.leaving is None
