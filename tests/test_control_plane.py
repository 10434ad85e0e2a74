"""The control plane: the worker policy's decisions, the controller's `sync` / `watch` / leases, and the call
bound the simulator measures with the workers' own policy."""

import time

import pytest

from actors.controller import ControllerActor, RolloutController, SyncReply, SyncRequest, WatchReply
from actors.worker_policy import PolicySettings, WorkerPolicy
from protocols.weight_announcement import WeightAnnouncement
from simulator.simulation import simulate
from tests.test_replay_queue import make_group, make_prompts
from tests.test_simulator import small


def controller(**kw) -> RolloutController:
    args = dict(prompts_per_step=2, max_staleness=1, drop_zero_variance=False, seed=0)
    return RolloutController(make_prompts(20), **{**args, **kw})


# --- the policy --------------------------------------------------------------------------------------------------
def test_policy_asks_for_a_batch_only_when_enough_slots_are_free():
    p = WorkerPolicy(PolicySettings(prompts_in_flight=8, min_groups_per_request=4), worker_id=0)
    assert p.sync_due(0.0, in_flight=0) and p.request(0.0, 0).want == 8  # first call: fill the engine
    p.on_reply(SyncReply(stop=False, weights=None))
    assert not p.sync_due(0.1, in_flight=5)  # 3 free < 4
    assert p.sync_due(0.1, in_flight=4) and p.request(0.1, 4).want == 4


def test_policy_hands_over_scored_groups_in_batches_or_after_the_poll_interval():
    p = WorkerPolicy(PolicySettings(prompts_in_flight=8, min_groups_per_request=4, poll_interval_s=0.5), 0)
    p.request(0.0, 0)
    p.on_scored("g0", "ref0", now=1.0)
    assert not p.sync_due(1.2, in_flight=7) and p.deadline() == 1.5
    assert p.sync_due(1.5, in_flight=7)  # held for poll_interval_s
    assert p.sync_due(1.2, in_flight=0)  # an idle engine hands over at once
    for i in range(1, 4):
        p.on_scored(f"g{i}", f"ref{i}", now=1.1)
    assert p.sync_due(1.2, in_flight=7)  # 4 scored groups
    req = p.request(1.2, 7)
    assert [g for g, _ in req.scored] == ["g0", "g1", "g2", "g3"] and p.scored == [] and p.deadline() is None


def test_starved_policy_waits_for_freed_budget_or_new_weights():
    p = WorkerPolicy(PolicySettings(prompts_in_flight=8, min_groups_per_request=4), 0)
    p.request(0.0, 0)
    p.on_reply(SyncReply(stop=False, weights=None, granted=[], starved=True))
    assert not p.sync_due(1.0, in_flight=0)
    p.on_watch(WatchReply(stop=False, weights=None, budget_freed=True))
    assert p.sync_due(1.0, in_flight=0)
    p.request(1.0, 0)
    p.on_reply(SyncReply(stop=False, weights=None, starved=True))
    p.on_watch(WatchReply(stop=False, weights=WeightAnnouncement(version=1, refs=["w1"])))
    assert p.want(0) == 0 and p.weights_to_load(0) == WeightAnnouncement(version=1, refs=["w1"])
    p.loaded(1)
    assert p.sync_due(2.0, in_flight=0) and p.request(2.0, 0).version == 1


def test_policy_loads_at_once_with_partial_rollouts_else_after_draining():
    drain = WorkerPolicy(PolicySettings(prompts_in_flight=4, partial_rollouts=False), 0)
    drain.on_watch(WatchReply(stop=False, weights=WeightAnnouncement(version=1)))
    assert drain.weights_to_load(in_flight=2) is None and drain.want(2) == 0  # no new work while draining
    assert drain.weights_to_load(in_flight=0) == WeightAnnouncement(version=1)
    partial = WorkerPolicy(PolicySettings(prompts_in_flight=4, partial_rollouts=True), 0)
    partial.on_watch(WatchReply(stop=False, weights=WeightAnnouncement(version=1)))
    assert partial.weights_to_load(in_flight=2) == WeightAnnouncement(version=1)


def test_the_next_runs_policy_holds_the_loaded_weights_and_nothing_else_of_the_last_run():
    # the worker's engine version has one owner: each run's policy hands it to the next one
    p = WorkerPolicy(PolicySettings(prompts_in_flight=4), 0)
    p.loaded(2)
    p.on_watch(WatchReply(stop=True, weights=WeightAnnouncement(version=3)))
    fresh = p.next_run()
    assert (fresh.loaded_version, fresh.versions_seen, fresh.stopped, fresh.newer) == (2, [0, 2], False, None)


def test_stopped_policy_makes_one_final_call_with_the_aborted_groups():
    p = WorkerPolicy(PolicySettings(prompts_in_flight=4), 0)
    p.on_scored("g0", "ref", now=0.0)
    p.on_watch(WatchReply(stop=True, weights=WeightAnnouncement(version=3)))
    assert not p.sync_due(0.0, 2) and p.weights_to_load(0) is None  # stop wins over newer weights
    final = p.final_request(["g1", "g2"])
    assert final.want == 0 and final.dropped == {"aborted_at_stop": ["g1", "g2"]} and len(final.scored) == 1


# --- the controller ----------------------------------------------------------------------------------------------
def test_sync_takes_scored_groups_before_granting_so_freed_budget_is_granted_at_once():
    # k=0, 2 prompts per step: budget 2. A zero-variance group handed back frees 1, granted in the same call.
    c = controller(max_staleness=0, drop_zero_variance=True)
    first = c.sync(SyncRequest(worker_id=0, version=0, want=4))
    assert [g for g, _ in first.granted] == ["g0", "g1"] and first.starved and first.max_in_flight == 2
    reply = c.sync(SyncRequest(worker_id=0, version=0, in_flight=1, want=1,
                               scored=[("g0", make_group("g0", [1, 1], 0))]))
    assert [g for g, _ in reply.granted] == ["g2"] and c.queue.dropped["zero_variance"] == 1


def test_sync_grants_nothing_while_the_worker_holds_old_weights():
    c = controller()
    c.publish(WeightAnnouncement(version=1, refs=["w1"]))
    reply = c.sync(SyncRequest(worker_id=0, version=0, want=4))
    assert reply.weights == WeightAnnouncement(version=1, refs=["w1"]) and reply.granted == []


def test_a_starved_worker_is_woken_when_a_drop_frees_budget_and_by_new_weights():
    c = controller(max_staleness=0, drop_zero_variance=True)
    c.sync(SyncRequest(worker_id=0, version=0, want=2))  # takes the whole budget of 2
    assert c.sync(SyncRequest(worker_id=1, version=0, want=2)).starved
    assert c.watch_news(1, known_version=0) is None  # nothing new yet: the long poll waits
    c.sync(SyncRequest(worker_id=0, version=0, scored=[("g0", make_group("g0", [0, 0], 0))]))  # dropped
    assert c.watch_news(1, known_version=0) == WatchReply(stop=False, weights=None, budget_freed=True)
    assert c.watch_news(1, known_version=0) is None  # delivered once
    c.publish(WeightAnnouncement(version=1))
    assert c.watch_news(1, known_version=0).weights == WeightAnnouncement(version=1)


def test_leases_record_the_holder_and_a_lost_workers_leases_free_the_window():
    t = [10.0]
    c = controller(max_staleness=0, clock=lambda: t[0])  # budget (0 + 0 + 1) * 2 = 2
    c.sync(SyncRequest(worker_id=7, version=0, want=2))
    assert c.leases == {"g0": (7, 10.0), "g1": (7, 10.0)} and c.leases_of(7) == ["g0", "g1"]
    assert c.budget(0) == 0
    assert c.release_worker(7) == ["g0", "g1"]
    assert c.budget(0) == 2 and c.queue.dropped["worker_lost"] == 2 and c.leases == {}
    t[0] = 11.0
    assert [g for g, _ in c.sync(SyncRequest(worker_id=8, version=0, want=2)).granted] == ["g2", "g3"]
    assert c.leases["g2"] == (8, 11.0)
    # the lost worker's group arriving late is ignored, not trained or counted twice
    c.sync(SyncRequest(worker_id=7, version=0, scored=[("g0", make_group("g0", [1, 0], 0))]))
    assert len(c.queue) == 0 and c.late_after_release == 1
    c.sync(SyncRequest(worker_id=8, version=0, scored=[("g2", make_group("g2", [1, 0], 0))],
                       dropped={"aborted_at_stop": ["g3"]}))
    s = c.stats()
    # admitted 4 = received (2 worker_lost + 1 queued + 1 aborted) + leased 0
    assert s["queue/admitted"] == s["queue/received"] + s["queue/leased"] == 4


def test_each_workers_first_scored_group_is_timed_once():
    # the elastic benchmark's "first sample of a new worker": wall time, beside a scale request's requested_at
    c = controller()  # budget (0 + 1 + 1) * 2 = 4
    c.sync(SyncRequest(worker_id=0, version=0, want=1))  # g0
    c.sync(SyncRequest(worker_id=1, version=0, want=2))  # g1, g2
    before = time.time()
    c.sync(SyncRequest(worker_id=1, version=0, scored=[("g1", make_group("g1", [1, 0], 0))]))
    first = c.get_first_scored_at()
    assert set(first) == {1} and before <= first[1] <= time.time()
    # a later group of worker 1 keeps its first time; a dropped group of worker 0 is no sample
    c.sync(SyncRequest(worker_id=1, version=0, scored=[("g2", make_group("g2", [1, 0], 0))]))
    c.sync(SyncRequest(worker_id=0, version=0, dropped={"aborted_at_stop": ["g0"]}))
    assert c.get_first_scored_at() == first


def test_leased_groups_round_trip_through_the_state_dict_as_groups_to_reissue():
    c = controller(clock=lambda: 5.0)
    c.sync(SyncRequest(worker_id=3, version=0, want=2))
    d = controller()
    d.load_state_dict(c.state_dict())
    # a resumed run has new workers: the groups are waiting for re-issue, with their prompts, held by no one
    assert d.leases == {} and [g for g, _ in d.reissue] == ["g0", "g1"] and d.state_dict() == c.state_dict()
    assert [p for _, p in d.reissue] == [c.lease_prompts["g0"], c.lease_prompts["g1"]]


# --- the bound, in the simulator -------------------------------------------------------------------------------
def test_controller_calls_stay_under_one_per_group_plus_a_constant_per_version_and_worker():
    cfg = small(num_engines=16, prompts_per_step=16, max_staleness=2)
    batched, legacy = simulate(cfg), simulate(cfg.model_copy(update={"control": "legacy"}))
    calls = sum(batched.controller_calls.values())
    versions_x_workers = cfg.steps * cfg.num_engines
    # per worker and version: one watch reply + one ask after loading, and a few asks or flushes that did not
    # coincide; 2 is the headroom for that constant
    assert calls <= batched.finished_groups + 2 * versions_x_workers, batched.controller_calls
    assert set(batched.controller_calls) == {"sync", "watch"}
    # the old loop polled at every decode step, which is far more than one call per group
    assert sum(legacy.controller_calls.values()) > 20 * calls
    assert legacy.controller_calls["poll"] > legacy.finished_groups * 10
    # the same admission and staleness rules: both train every step, within the bound
    assert len(batched.trained_group_ids) == len(legacy.trained_group_ids) == 10 * 16
    assert batched.max_staleness_observed <= 2 and legacy.max_staleness_observed <= 2


# --- the Ray actor ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_controller_actor_queues_handed_over_groups_and_long_polls(ray_cluster):
    ray = ray_cluster
    actor = ray.remote(ControllerActor).options(num_cpus=0).remote(
        make_prompts(20), 2, 1, False, 0, 1)
    try:
        granted = ray.get(actor.sync.remote(SyncRequest(worker_id=0, version=0, want=2))).granted
        assert [g for g, _ in granted] == ["g0", "g1"]
        watch = actor.watch.remote(0, 0)
        time.sleep(0.5)
        assert not ray.wait([watch], timeout=0)[0]  # waits for news
        # scored groups held inline (no reward workers: the stage has nothing to run); g1 comes back dropped
        request = SyncRequest(worker_id=0, version=0, scored=[("g0", make_group("g0", [1, 0], 0))],
                              dropped={"aborted_at_stop": ["g1"]})
        ray.get(actor.sync.remote(request))
        stats = ray.get(actor.stats.remote())
        assert stats["queue/depth"] == 1 and stats["queue/dropped_aborted_at_stop"] == 1
        assert stats["queue/leased"] == 0
        # the driver's long poll: one group queued of the 2 a batch needs, so it times out with None ...
        assert ray.get(actor.wait_batch.remote(0, 0.2)) is None
        batch = actor.wait_batch.remote(0, 30.0)
        granted = ray.get(actor.sync.remote(SyncRequest(worker_id=0, version=0, want=1))).granted
        ray.get(actor.sync.remote(SyncRequest(worker_id=0, version=0, scored=[(granted[0][0], make_group("g2", [1, 0], 0))])))
        # ... and answers as soon as the second one is queued
        assert [g.group_id for g in ray.get(batch, timeout=30)] == ["g0", "g2"]
        ray.get(actor.publish.remote(WeightAnnouncement(version=1, refs=["w1"])))
        assert ray.get(watch, timeout=30) == WatchReply(stop=False, weights=WeightAnnouncement(version=1, refs=["w1"]))
    finally:
        ray.kill(actor)
