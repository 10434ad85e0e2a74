"""Scoring routes and retries (actors/score_router.py) driven with stand-in workers, without Ray."""

from types import SimpleNamespace

from actors.controller_messages import SyncReply, SyncRequest
from actors.score_router import ScoreRouter
from actors.stream_join import StreamedGroup
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup


class StandIn:
    """A worker handle: `score_group.remote(x)` / `add_values.remote(x)` return a task id and record the call."""

    def __init__(self, name: str, calls: list) -> None:
        self.name = name
        self.score_group = SimpleNamespace(remote=lambda x: self._task("score", x, calls))
        self.add_values = SimpleNamespace(remote=lambda x: self._task("values", x, calls))

    def _task(self, kind, x, calls):
        task = f"{self.name}:{kind}:{len(calls)}"
        calls.append((self.name, x))
        return task


def group(group_id: str) -> TrajectoryGroup:
    t = Trajectory(group_id=group_id, sample_index=0, prompt=Prompt(prompt_id="p", prompt_token_ids=[1]),
                   response_token_ids=[2], behavior_logprobs=[-1.0], token_versions=[0], finish_reason="stop")
    return TrajectoryGroup(group_id=group_id, trajectories=[t])


def router(calls, rewards=("r0", "r1"), references=(), critics=(), ready=None, attempts=1, teachers=()):
    ready = ready if ready is not None else set()
    scorers = {"reference": [StandIn(n, calls) for n in references], "teacher": [StandIn(n, calls) for n in teachers]}
    return ScoreRouter([StandIn(n, calls) for n in rewards], scorers, [StandIn(n, calls) for n in critics], max_rescore_attempts=attempts, batch_timeout_s=0.0,
                       put=lambda g: f"put:{g.group_id}",
                       wait=lambda refs, n, timeout: ([r for r in refs if r in ready], []))


def test_groups_go_round_robin_and_finished_tasks_are_handed_over():
    calls, ready = [], set()
    r = router(calls, ready=ready)
    for g in ("g0", "g1", "g2"):
        r.send(group(g))
    assert [name for name, _ in calls] == ["r0", "r1", "r0"]
    assert r.collect() == []
    ready.add("r1:score:1")
    assert r.collect() == [("g1", "r1:score:1")] and list(r.scoring.values()) == ["g0", "g2"]


def test_a_group_whose_reward_worker_died_goes_to_a_live_one_then_is_dropped_after_the_attempts():
    # max_rescore_attempts 1: g0 met dead r0, is sent to r1; it meets a dead worker again and is dropped
    calls = []
    r = router(calls)
    r.send(group("g0"))
    request = SyncRequest(worker_id=0, version=0, scored=[("g0", "r0:score:0")])
    assert r.on_reply(request, SyncReply(stop=False, weights=None, rescore=["g0"])) == {}
    assert calls[-1][0] == "r1" and r.counts["rescored"] == 1
    r.send(group("g1"))  # r0 is known dead: r1 again
    assert calls[-1][0] == "r1"
    request = SyncRequest(worker_id=0, version=0, scored=[("g0", "r1:score:1")])
    assert r.on_reply(request, SyncReply(stop=False, weights=None, rescore=["g0"])) == {
        "reward_worker_died": ["g0"]}
    assert r.counts["dropped_reward_worker_died"] == 1 and "g0" not in r.sent


def test_with_every_reward_worker_dead_groups_wait_for_the_new_list():
    calls = []
    r = router(calls, rewards=("r0",))
    r.send(group("g0"))
    r.on_reply(SyncRequest(worker_id=0, version=0, scored=[("g0", "t")]),
               SyncReply(stop=False, weights=None, rescore=["g0"]))
    assert [g.group_id for g, _ in r.unsent] == ["g0"]
    reply = SyncReply(stop=False, weights=None, reward_workers=(1, [StandIn("r9", calls)]))
    r.on_reply(SyncRequest(worker_id=0, version=0), reply)
    assert r.unsent == [] and calls[-1][0] == "r9" and r.stamp(SyncRequest(0, 0)).reward_generation == 1


def test_reference_runs_beside_the_reward_and_a_group_is_handed_over_once_both_finished():
    calls, ready = [], set()
    r = router(calls, rewards=("r0",), references=("ref0",), ready=ready)
    r.send(group("g0"))
    # one put, read by both tasks
    assert calls == [("ref0", "put:g0"), ("r0", "put:g0")]
    ready.add("r0:score:1")
    assert r.collect() == []  # the reference task is still running
    ready.add("ref0:score:0")
    ((group_id, item),) = r.collect()
    assert group_id == "g0" and item == StreamedGroup("r0:score:1", {"reference": ("ref0:score:0", 0)})


def test_teacher_and_reference_both_score_beside_the_reward_and_a_dead_teacher_resends_the_whole_group():
    calls, ready = [], set()
    r = router(calls, rewards=("r0",), references=("ref0",), teachers=("t0", "t1"), ready=ready)
    r.send(group("g0"))
    # one put, read by the three tasks: reference, teacher, reward
    assert calls == [("ref0", "put:g0"), ("t0", "put:g0"), ("r0", "put:g0")]
    ready.update({"r0:score:2", "ref0:score:0"})
    assert r.collect() == []  # the teacher's task is still running
    ready.add("t0:score:1")
    ((group_id, item),) = r.collect()
    assert item == StreamedGroup("r0:score:2", {"reference": ("ref0:score:0", 0), "teacher": ("t0:score:1", 0)})
    # t0 died before scoring g0: every stage runs again, the teacher part on t1 (t0 is known dead)
    request = SyncRequest(worker_id=0, version=0, scored=[("g0", item)])
    assert r.on_reply(request, SyncReply(stop=False, weights=None, rescore_model={"teacher": ["g0"]})) == {}
    assert [name for name, _ in calls[3:]] == ["ref0", "t1", "r0"] and r.counts["rescored_teacher"] == 1
    # past max_rescore_attempts (1) the group is dropped under the teacher's reason
    request = SyncRequest(worker_id=0, version=0, scored=[("g0", "r0:score:5")])
    assert r.on_reply(request, SyncReply(stop=False, weights=None, rescore_model={"teacher": ["g0"]})) == {
        "teacher_worker_died": ["g0"]}
    assert r.counts["dropped_teacher_worker_died"] == 1


def test_with_every_teacher_worker_dead_groups_wait_and_give_up_names_the_teacher():
    calls = []
    r = router(calls, rewards=("r0",), teachers=("t0",), ready={"r0:score:1", "t0:score:0"})
    r.send(group("g0"))
    ((_, item),) = r.collect()
    r.on_reply(SyncRequest(worker_id=0, version=0, scored=[("g0", item)]),
               SyncReply(stop=False, weights=None, rescore_model={"teacher": ["g0"]}))
    assert [g.group_id for g, _ in r.unsent] == ["g0"]
    assert r.give_up() == {"teacher_worker_died": ["g0"]}


def test_critic_is_chained_after_the_reward_and_a_dead_critic_holds_groups_until_the_restart():
    calls = []
    r = router(calls, rewards=("r0",), critics=("c0",))
    r.send(group("g0"))
    assert calls[-1] == ("c0", "r0:score:0") and list(r.scoring) == ["c0:values:1"]
    r.on_reply(SyncRequest(worker_id=0, version=0, scored=[("g0", "c0:values:1")]),
               SyncReply(stop=False, weights=None, rescore_critic=["g0"]))
    assert r.counts["rescored_critic"] == 1 and [g.group_id for g, _ in r.unsent] == ["g0"]
    r.on_reply(SyncRequest(worker_id=0, version=0),
               SyncReply(stop=False, weights=None, model_workers=(1, {"critic": [StandIn("c1", calls)]})))
    assert calls[-1][0] == "c1" and r.unsent == []


def test_give_up_reports_waiting_and_unfinished_groups_by_reason():
    # as at stop: g0 waits for a live reward worker (its only one died), g1's task did not finish in time
    calls = []
    r = router(calls, rewards=("r0",), ready={"r0:score:1"})
    r.send(group("g1"))
    r.send(group("g0"))
    assert r.collect() == [("g0", "r0:score:1")]
    r.on_reply(SyncRequest(worker_id=0, version=0, scored=[("g0", "r0:score:1")]),
               SyncReply(stop=False, weights=None, rescore=["g0"]))
    assert r.give_up() == {"reward_worker_died": ["g0"], "reward_timeout": ["g1"]}
    assert r.scoring == {} and r.unsent == [] and r.sent == {}
