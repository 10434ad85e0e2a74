"""The controller's scoring stage (actors/scoring_stage.py) with stand-in workers: what every role returns lands on
the header, and one rule covers every role's death, raise and silence."""

import asyncio

import pytest

from actors.scoring_stage import ScoringStage
from protocols.group_header import GroupHeader
from tests.test_replay_queue import make_group


class Died(Exception):
    """A stand-in worker's death (Ray raises RayActorError)."""


class StandIn:
    """A worker of any role: `behaviour` is "ok", "dies", "raises" or "hangs"; `calls` records (name, method)."""

    def __init__(self, name: str, behaviour: str = "ok", calls: list | None = None) -> None:
        self.name, self.behaviour, self.calls = name, behaviour, calls if calls is not None else []


def call(worker: StandIn, method: str, returns: int, groups: list) -> object:
    """The stage's `call`, in place of Ray: what the worker's method would return for a batch, as awaitables."""
    worker.calls.append((worker.name, method, len(groups)))

    async def first():
        if worker.behaviour == "dies":
            raise Died(worker.name)
        if worker.behaviour == "raises":
            raise RuntimeError("CUDA out of memory")
        if worker.behaviour == "hangs":
            await asyncio.sleep(60)
        if method == "score_groups":
            return [([1.0, 0.0], [None, None])] * len(groups)
        return [len(g.trajectories) for g in groups]

    assert returns == (1 if method == "score_groups" else 1 + len(groups))
    return first() if returns == 1 else [first(), *(f"rows of {g.group_id} by {worker.name}" for g in groups)]


def stage_of(workers: dict[str, list], max_attempts: int = 1, timeout_s: float = 5.0) -> tuple:
    """(stage, what it reports: {"scored": [...], "dropped": [...], "fatal": [...]})."""
    out = {"scored": [], "dropped": [], "fatal": []}
    stage = ScoringStage(max_attempts, timeout_s, out["scored"].append,
                         lambda reason, g: out["dropped"].append((reason, g)), out["fatal"].append,
                         call=call, died=lambda err: isinstance(err, Died))
    for role, handles in workers.items():
        stage.set_workers(role, handles)
    return stage, out


def score(stage: ScoringStage, *headers: GroupHeader, then=None, together: bool = False) -> None:
    """Submit the headers one hand-over each, or all in one (`together`), and run the stage until it is done."""
    async def run():
        for batch in [headers] if together else [[h] for h in headers]:
            stage.submit(*batch)
        await asyncio.sleep(0)
        if then is not None:
            await then()
        await asyncio.gather(*stage.pending.values())

    asyncio.run(run())


def header(group_id: str = "g0", rewarded: bool = False) -> GroupHeader:
    return GroupHeader.of(make_group(group_id, [0, 0], 3), rewarded=rewarded)


def test_every_role_scores_the_group_and_only_small_returns_are_awaited():
    calls: list = []
    stage, out = stage_of({"reward": [StandIn("r0", calls=calls)], "reference": [StandIn("ref0", calls=calls)],
                           "teacher": [StandIn("t0", calls=calls)]})
    score(stage, header())
    (scored,) = out["scored"]
    assert scored.rewards == [1.0, 0.0] and scored.results == [None, None]
    # the rows stay where the worker left them (a ref in Ray): the header carries the second return as it came
    assert scored.scores == {"reference": "rows of g0 by ref0", "teacher": "rows of g0 by t0"}
    assert scored.min_version == 3
    assert sorted(calls) == [("r0", "score_groups", 1), ("ref0", "score_rows", 1), ("t0", "score_rows", 1)]
    assert out["dropped"] == out["fatal"] == [] and stage.pending == {}


def test_a_hand_overs_groups_are_scored_in_one_task_per_role_and_each_gets_its_own_rows():
    calls: list = []
    stage, out = stage_of({"reward": [StandIn("r0", calls=calls)], "reference": [StandIn("ref0", calls=calls)]})
    # three groups to reward and one a client rewarded: two batches, by the roles each needs
    score(stage, header("g0"), header("g1"), header("s0", rewarded=True), header("g2"), together=True)
    assert sorted(calls) == [("r0", "score_groups", 3), ("ref0", "score_rows", 1), ("ref0", "score_rows", 3)]
    scored = {h.group_id: h for h in out["scored"]}
    assert sorted(scored) == ["g0", "g1", "g2", "s0"] and out["dropped"] == []
    assert [scored[g].scores["reference"] for g in ("g0", "g1", "g2")] == [
        "rows of g0 by ref0", "rows of g1 by ref0", "rows of g2 by ref0"]
    assert scored["g1"].rewards == [1.0, 0.0] and stage.pending == {}


def test_a_batch_whose_workers_die_is_resent_whole_then_dropped_group_by_group():
    calls: list = []
    stage, out = stage_of({"reward": [StandIn("a", "dies", calls), StandIn("b", "dies", calls)]})
    score(stage, header("g0"), header("g1"), together=True)
    assert calls == [("b", "score_groups", 2), ("a", "score_groups", 2)]  # round robin, then the other
    assert sorted(out["dropped"]) == [("reward_worker_died", "g0"), ("reward_worker_died", "g1")]
    stage, out = stage_of({"reward": [StandIn("r0", "raises")]})
    score(stage, header("g0"), header("g1"), together=True)
    assert "reward worker 0 raised on groups g0, g1: RuntimeError" in out["fatal"][0]
    assert sorted(out["dropped"]) == [("scoring_failed", "g0"), ("scoring_failed", "g1")]


def test_a_rewarded_group_skips_the_reward_and_goes_straight_through_without_other_roles():
    calls: list = []
    stage, out = stage_of({"reward": [StandIn("r0", calls=calls)], "teacher": [StandIn("t0", calls=calls)]})
    assert stage.roles_for(header(rewarded=True)) == ["teacher"]
    score(stage, header(rewarded=True))
    assert calls == [("t0", "score_rows", 1)] and out["scored"][0].scores == {"teacher": "rows of g0 by t0"}
    bare, _ = stage_of({"reward": [StandIn("r0")]})
    assert bare.roles_for(header(rewarded=True)) == []  # the controller queues it without the stage


def test_a_dead_workers_task_goes_to_a_live_one_and_the_dead_one_is_skipped_after():
    calls: list = []
    stage, out = stage_of({"reward": [StandIn("dead", "dies", calls), StandIn("live", calls=calls)]})
    score(stage, header("g0"), header("g1"), header("g2"))
    assert sorted(h.group_id for h in out["scored"]) == ["g0", "g1", "g2"] and out["dropped"] == []
    assert calls.count(("dead", "score_groups", 1)) == 1  # marked dead at its first death
    assert stage.counts["rescored_reward_worker_died"] == 1 and stage.dead["reward"] == {0}


def test_after_max_attempts_of_dying_workers_the_group_is_dropped_under_the_roles_reason():
    stage, out = stage_of({"reward": [StandIn("r0")], "reference": [StandIn("a", "dies"), StandIn("b", "dies")]})
    score(stage, header())
    assert out["dropped"] == [("reference_worker_died", "g0")] and out["scored"] == []
    # PPO's critic is no scoring role: it values the batch at train time (cluster/critic_pool.py)
    with pytest.raises(ValueError, match="unknown scoring role 'critic'"):
        stage.set_workers("critic", [])


def test_a_role_with_no_live_worker_waits_for_the_drivers_new_list():
    stage, out = stage_of({"reward": [StandIn("dead", "dies")]}, max_attempts=1)

    async def replace():
        await asyncio.sleep(0.05)
        assert stage.pending  # waiting, not dropped
        stage.set_workers("reward", [StandIn("new")])

    score(stage, header(), then=replace)
    assert [h.group_id for h in out["scored"]] == ["g0"] and stage.generation["reward"] == 2


def test_a_worker_that_raises_stops_the_run_with_the_error_and_the_fix():
    stage, out = stage_of({"reward": [StandIn("r0")], "reference": [StandIn("ref0", "raises")]})
    score(stage, header())
    (message,) = out["fatal"]
    assert "reference worker 0 raised on group g0: RuntimeError: CUDA out of memory" in message
    assert "reference.max_tokens_per_micro_batch" in message and "reference.num_workers=0" in message
    assert out["dropped"] == [("scoring_failed", "g0")]
    stage, out = stage_of({"reward": [StandIn("r0", "raises")]})
    score(stage, header())
    assert "reward worker 0 raised" in out["fatal"][0] and "reward.verifier" in out["fatal"][0]


def test_every_wait_is_bounded_by_the_timeout():
    stage, out = stage_of({"reward": [StandIn("slow", "hangs")]}, timeout_s=0.05)
    score(stage, header())
    assert out["dropped"] == [("scoring_timeout", "g0")]
    stage, out = stage_of({"reward": []}, timeout_s=0.05)
    score(stage, header())
    assert out["dropped"] == [("reward_worker_died", "g0")]


def test_an_unknown_role_is_refused_by_name():
    stage, _ = stage_of({})
    with pytest.raises(ValueError, match="unknown scoring role 'judge'"):
        stage.set_workers("judge", [])


def test_the_header_assembles_the_group_the_learner_reads():
    group = make_group("g0", [0, 0], 3)
    head = GroupHeader.of(group).scored([1.0, 0.5], [None, None])
    rows = [[-0.5] * len(t.response_token_ids) for t in group.trajectories]
    out = head.assemble(group, {"reference": rows, "teacher": rows})
    assert [t.reward for t in out.trajectories] == [1.0, 0.5]
    assert out.trajectories[1].ref_logprobs == rows[1] and out.trajectories[0].teacher_logprobs == rows[0]
    assert [t.reward for t in group.trajectories] == [0, 0]  # the original is untouched
    with pytest.raises(ValueError, match="3 rewards and 1 results for its 2 samples"):
        head.scored([1.0, 0.0, 1.0], [None])
