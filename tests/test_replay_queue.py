"""The replay queue and the controller's admission rule, driven directly (no Ray)."""

from actors.controller import PromptCursor, RolloutController
from actors.controller_messages import SyncRequest
from actors.replay_queue import ReplayQueue
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup
from protocols.weight_announcement import WeightAnnouncement


def make_prompts(n: int) -> list[Prompt]:
    return [Prompt(prompt_id=f"p{i}", prompt_token_ids=[1, i]) for i in range(n)]


def make_group(group_id: str, rewards: list[float], version: int) -> TrajectoryGroup:
    prompt = Prompt(prompt_id="p", prompt_token_ids=[1])
    trajectories = [
        Trajectory(group_id=group_id, sample_index=i, prompt=prompt, response_token_ids=[5, 6],
                   behavior_logprobs=[-0.5, -0.5], token_versions=[version, version], finish_reason="stop", reward=r)
        for i, r in enumerate(rewards)
    ]
    return TrajectoryGroup(group_id=group_id, trajectories=trajectories)


def ask(c: RolloutController, worker_id: int, version: int, want: int, in_flight: int = 0,
        scored: list[TrajectoryGroup] = ()) -> list:
    """A worker's `sync` call: hand over `scored`, ask for `want` groups; returns the groups granted."""
    request = SyncRequest(worker_id=worker_id, version=version, in_flight=in_flight, want=want,
                          scored=[(g.group_id, g) for g in scored])
    return c.sync(request).granted


def test_zero_variance_groups_are_dropped_and_counted():
    q = ReplayQueue(max_staleness=0, drop_zero_variance=True)
    assert q.put(make_group("a", [1, 1], 0)) is False
    assert q.put(make_group("b", [1, 0], 0)) is True
    assert len(q) == 1 and q.dropped["zero_variance"] == 1 and q.received == 2


def test_zero_variance_drops_say_whether_the_group_was_too_easy_or_too_hard():
    q = ReplayQueue(max_staleness=0, drop_zero_variance=True)
    for group_id, rewards in (("easy", [1, 1]), ("hard", [0, 0]), ("hard2", [0, 0]), ("mixed", [1, 0])):
        q.put(make_group(group_id, rewards, 0))
    # 3 dropped as zero variance, of which 1 all rewarded ("easy"); "mixed" is queued
    assert (q.dropped["zero_variance"], q.zero_variance_rewarded, len(q)) == (3, 1, 1)
    c = RolloutController(make_prompts(2), prompts_per_step=1, max_staleness=0, drop_zero_variance=True, seed=0)
    c.queue = q
    assert c.stats()["queue/zero_variance_rewarded"] == 1


def test_generated_lengths_count_dropped_groups_and_reset_after_each_read():
    q = ReplayQueue(max_staleness=0, drop_zero_variance=True)
    long_cut = make_group("long", [0, 0], 0)  # all wrong: dropped, but its lengths still count
    for t, n in zip(long_cut.trajectories, (100, 300)):
        t.response_token_ids, t.finish_reason = [5] * n, "length"
    q.put(long_cut)
    q.put(make_group("short", [1, 0], 0))  # 2 samples of 2 tokens
    # lengths 2, 2, 100, 300: mean 404 / 4 = 101; p50 = 2nd of 4 = 2; p99 and max = 300; 2 of 4 cut at the limit
    assert q.generated_metrics() == {
        "generated/samples": 4.0, "generated/length_mean": 101.0, "generated/length_p50": 2.0,
        "generated/length_p99": 300.0, "generated/length_max": 300.0, "generated/truncated_frac": 0.5}
    assert q.generated_metrics() == {"generated/samples": 0.0}  # read once: the next step starts afresh
    assert len(q) == 1 and q.dropped["zero_variance"] == 1


def test_a_sample_out_of_turns_counts_as_truncated_as_in_the_trained_batch():
    from protocols.training_batch import TrainingBatch

    q = ReplayQueue(max_staleness=0, drop_zero_variance=False)
    group = make_group("tools", [1, 0], 0)
    group.trajectories[0].finish_reason = "max_turns"  # the agent loop ran out of tools.max_turns
    q.put(group)
    # 1 of 2 truncated, in the generated/ window and in the batch the learner trains on (response/truncated_frac)
    assert q.generated_metrics()["generated/truncated_frac"] == 0.5
    assert TrainingBatch.from_trajectories(group.trajectories).truncated.tolist() == [True, False]


def test_take_waits_for_a_full_batch_and_keeps_groups_whole():
    q = ReplayQueue(max_staleness=0, drop_zero_variance=False)
    q.put(make_group("a", [1, 0], 0))
    assert q.take(2, learner_version=0) is None
    assert len(q) == 1  # nothing removed by a failed take
    q.put(make_group("b", [0, 1], 0))
    batch = q.take(2, learner_version=0)
    assert [g.group_id for g in batch] == ["a", "b"]
    assert all(g.num_samples == 2 and g.inline().trajectories[1].sample_index == 1 for g in batch)


def test_staleness_bound_in_versions():
    # learner at version 3 with max_staleness 1 accepts versions >= 2 only
    q = ReplayQueue(max_staleness=1, drop_zero_variance=False)
    for name, version in (("v1", 1), ("v2", 2), ("v3", 3)):
        q.put(make_group(name, [1, 0], version))
    batch = q.take(2, learner_version=3)
    assert [g.group_id for g in batch] == ["v2", "v3"]
    assert q.dropped["stale"] == 1


def test_partial_rollout_group_is_as_old_as_its_oldest_token():
    group = make_group("g", [1, 0], 4)
    group.trajectories[1].token_versions = [3, 4]
    assert group.min_version == 3


def test_every_received_group_is_trained_dropped_or_waiting():
    q = ReplayQueue(max_staleness=0, drop_zero_variance=True)
    for i in range(7):
        q.put(make_group(f"g{i}", [1, 0] if i % 3 else [0, 0], i % 2))
    q.take(2, learner_version=1)
    assert q.received == q.trained + sum(q.dropped.values()) + len(q)


def test_admission_allows_max_staleness_plus_one_batches():
    # prompts_per_step 2, max_staleness 1: a worker at version 0 may start (0 + 1 + 1) * 2 = 4 groups
    c = RolloutController(make_prompts(10), prompts_per_step=2, max_staleness=1, drop_zero_variance=False, seed=0)
    assert len(ask(c, worker_id=0, version=0, want=10)) == 4
    assert ask(c, 0, 0, 10) == []
    # after one published version the worker may start 2 more
    assert len(ask(c, 0, 1, 10)) == 2


def test_dropped_groups_free_admission_budget():
    # at max_staleness 0 a zero-variance drop must be replaced, or the learner would wait forever
    c = RolloutController(make_prompts(10), prompts_per_step=2, max_staleness=0, drop_zero_variance=True, seed=0)
    assert len(ask(c, 0, 0, 10)) == 2
    # g0 comes back zero-variance and is dropped: the budget it frees is granted in the same call
    assert len(ask(c, 0, 0, 10, in_flight=1, scored=[make_group("g0", [0, 0], 0)])) == 1


def test_controller_state_round_trips():
    c = RolloutController(make_prompts(5), prompts_per_step=2, max_staleness=1, drop_zero_variance=False, seed=3)
    ask(c, 0, 0, 3)
    ask(c, 0, 0, 0, scored=[make_group("g0", [1, 0], 0)])
    state = c.state_dict()
    d = RolloutController(make_prompts(5), prompts_per_step=2, max_staleness=1, drop_zero_variance=False, seed=3)
    d.load_state_dict(state)
    assert d.state_dict() == state
    assert d.cursor.next().prompt_id == c.cursor.next().prompt_id


def test_cursor_visits_every_prompt_once_per_epoch():
    cursor = PromptCursor(make_prompts(4), seed=1)
    first = {cursor.next().prompt_id for _ in range(4)}
    assert first == {"p0", "p1", "p2", "p3"} and cursor.epoch == 0
    cursor.next()
    assert cursor.epoch == 1


def test_synchronous_admission_splits_the_batch_over_workers():
    # prompts_per_step 4 over 2 workers at max_staleness 0: each may hold ceil(4 / 2) = 2 groups in flight
    c = RolloutController(make_prompts(10), prompts_per_step=4, max_staleness=0, drop_zero_variance=False, seed=0,
                          num_workers=2)
    assert len(ask(c, worker_id=0, version=0, want=10, in_flight=0)) == 2
    assert ask(c, worker_id=0, version=0, want=10, in_flight=2) == []
    assert len(ask(c, worker_id=1, version=0, want=10, in_flight=0)) == 2


def test_watch_reports_stop_and_newer_weights_in_one_reply():
    c = RolloutController(make_prompts(2), prompts_per_step=1, max_staleness=0, drop_zero_variance=False, seed=0)
    assert c.watch_news(0, known_version=0) is None
    c.publish(WeightAnnouncement(version=1, refs=["ref"]))
    c.stop()
    news = c.watch_news(0, known_version=0)
    assert news.stop and news.weights == WeightAnnouncement(version=1, refs=["ref"])


def test_a_queue_saved_with_stream_values_loads_without_them():
    # a checkpoint from before the critic left the stream: its trajectories carry values and critic_version
    q = ReplayQueue(max_staleness=4, drop_zero_variance=False)
    q.put(make_group("g0", [0.0, 1.0], 1))
    state = q.state_dict()
    for t in state["groups"][0]["trajectories"]:
        t.update(values=[0.5] * len(t["response_token_ids"]), critic_version=1)
    loaded = ReplayQueue(max_staleness=4, drop_zero_variance=False)
    loaded.load_state_dict(state)
    (header,) = loaded.headers()
    assert header.group_id == "g0" and header.inline().rewards == [0.0, 1.0]
