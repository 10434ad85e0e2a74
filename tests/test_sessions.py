"""The session endpoint's bookkeeping (gateway/sessions.py), without a server: which sessions train, how they
group, and the statuses a late or repeated reward gets. The clock is a list the test moves."""

import pytest

from gateway.chat_render import ChatRenderer
from gateway.episode import ChatCall
from gateway.sessions import SessionBook, SessionError
from tests.tiny_chat_tokenizer import build_chat_tokenizer


@pytest.fixture(scope="module")
def renderer(tmp_path_factory):
    return ChatRenderer(build_chat_tokenizer(tmp_path_factory.mktemp("tok")))


def book_of(renderer, group_size=2, now=None):
    now = now if now is not None else [0.0]
    return SessionBook(renderer, "extend", max_sessions=8, timeout_s=10.0, train_group_size=group_size,
                       clock=lambda: now[0])


def one_call(book, session):
    """A served call: 2 sampled tokens at version 0."""
    call = ChatCall([{"role": "user", "content": "q"}])
    session.episode.record(call, session.episode.plan(call), {"role": "assistant", "content": "a"},
                           [67, 2], [-0.1, -0.2], [0, 0], "stop")


def test_sessions_without_a_key_fill_groups_of_the_learners_size(renderer):
    book = book_of(renderer)
    a, b, c = book.create(), book.create(), book.create()
    assert a.group is b.group and c.group is not a.group
    for s, r in ((a, 1.0), (b, 0.0)):
        one_call(book, s)
        book.set_reward(s, r)
    (group,) = book.take_groups()
    # one sample per session, their rewards, indices 0 and 1 in the group
    assert [t.reward for t in group.trajectories] == [1.0, 0.0]
    assert [t.sample_index for t in group.trajectories] == [0, 1]
    assert group.group_id == a.group.group_id != c.group.group_id
    assert (book.counts["sessions_rewarded"], book.counts["groups"], book.counts["samples"]) == (2, 1, 2)


def test_a_group_short_of_samples_is_dropped_and_counted(renderer):
    book = book_of(renderer)
    a, b = book.create("task-1"), book.create("task-1")
    one_call(book, a)
    one_call(book, b)
    book.set_reward(a, 1.0)
    book.finish(b)  # no reward: not trained, so the group holds 1 sample where the learner takes 2
    assert book.take_groups() == []
    assert (book.counts["sessions_no_reward"], book.counts["groups_wrong_size"]) == (1, 1)
    # the key is free again: a new group, with a new id
    assert book.create("task-1").group.group_id != a.group.group_id


def test_rewards_twice_late_bad_or_during_a_call_are_refused_with_their_status(renderer):
    now = [0.0]
    book = book_of(renderer, now=now)
    s = book.create()
    one_call(book, s)
    # 10**400 is past a float's range: math.isfinite raises OverflowError on it, so it is checked apart
    for bad in ("high", float("nan"), True, {"score": 1}, 10**400, {"reward": 10**400}):
        with pytest.raises(SessionError) as err:
            book.set_reward(s, bad)
        assert err.value.status == 400
    s.calls_in_flight = 1
    with pytest.raises(SessionError) as err:
        book.set_reward(s, 1.0)
    assert err.value.status == 409
    s.calls_in_flight = 0
    book.set_reward(s, {"reward": 1, "correct": True})
    assert s.info == {"correct": True}
    with pytest.raises(SessionError) as err:
        book.set_reward(s, 1.0)
    assert err.value.status == 409
    late = book.create()
    now[0] = 10.0  # its deadline (timeout 10 s)
    with pytest.raises(SessionError) as err:
        book.set_reward(late, 1.0)
    assert err.value.status == 410 and book.counts["sessions_no_reward"] == 1


def test_keys_select_their_session_only(renderer):
    book = book_of(renderer)
    a, b = book.create(), book.create()
    assert book.get(None, a.api_key) is a and book.get(b.session_id, b.api_key) is b
    for session_id, key, status in ((a.session_id, b.api_key, 401), ("nope", a.api_key, 404), (None, "x", 401)):
        with pytest.raises(SessionError) as err:
            book.get(session_id, key)
        assert err.value.status == status


def test_every_finished_session_leaves_a_record_trained_or_not(renderer, tmp_path):
    book = SessionBook(renderer, "extend", 8, 10.0, train_group_size=2, records=tmp_path / "episodes.jsonl")
    a, b = book.create(), book.create()
    one_call(book, a)
    book.lose_call(b)
    book.set_reward(a, 1.0)
    book.finish(b)
    import json

    rows = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert [(r["session_id"], r["trained"], r["lost"]) for r in rows] == [
        (a.session_id, True, False), (b.session_id, False, True)]
    (call,) = rows[0]["calls"]
    assert (call["sampled_ids"], call["token_versions"], call["parent"]) == ([67, 2], [0, 0], None)
    assert rows[0]["samples"] == [{"calls": [0], "prompt_tokens": len(call["prompt_ids"]), "loss_mask": [1, 1]}]


def test_a_group_not_filled_within_the_session_timeout_is_dropped_and_its_key_starts_afresh(renderer):
    now = [0.0]
    book = book_of(renderer, now=now)  # timeout 10 s, groups of 2
    a = book.create("task-1")
    one_call(book, a)
    book.set_reward(a, 1.0)
    now[0] = 9.0
    b = book.create("task-2")  # another group, opened later
    assert (book.open_groups, book.counts["groups_incomplete"]) == (2, 0)
    now[0] = 10.0  # task-1's first session opened 10 s ago, and its second never came
    book.sweep()
    assert (book.open_groups, book.counts["groups_incomplete"]) == (1, 1)
    assert book.take_groups() == []
    # the key is free again; the rewarded session of the dropped group never trains
    c = book.create("task-1")
    assert c.group is not a.group and c.group.group_id != a.group.group_id
    assert b.group is book.create("task-2").group  # task-2 fills: 9 s + 10 s is its own bound
    assert book.counts["groups_opened"] == 3 and book.open_groups == 2


def test_an_anonymous_group_left_half_full_is_dropped_and_the_next_session_opens_a_new_one(renderer):
    now = [0.0]
    book = book_of(renderer, now=now)
    a = book.create()
    now[0] = 10.0
    book.sweep()
    assert book.create().group is not a.group and book.counts["groups_incomplete"] == 1


def test_a_group_with_no_rewarded_session_is_counted_untrained(renderer):
    book = book_of(renderer)
    a, b = book.create("task-1"), book.create("task-1")
    one_call(book, a)
    book.finish(a)
    book.finish(b)  # no call, no reward
    assert book.take_groups() == []
    c = book.counts
    assert (c["groups_untrained"], c["groups_wrong_size"], c["sessions_no_reward"], book.open_groups) == (1, 0, 2, 0)
