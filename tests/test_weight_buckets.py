"""How the learner ranks split the weights for ZeRO-3 gathers (learner/rank_weights.py `buckets`): a weight
publish and a model save gather `weight_sync.bucket_mb` at a time, never the whole model."""

from learner.rank_weights import buckets


def test_a_bucket_closes_once_it_reaches_the_limit():
    # limit 10: 4+4 = 8 stays open, +4 = 12 closes it; 3+3 = 6 is the rest
    assert buckets([4, 4, 4, 3, 3], 10) == [[0, 1, 2], [3, 4]]
    # exactly at the limit closes too
    assert buckets([5, 5, 5], 10) == [[0, 1], [2]]


def test_an_entry_larger_than_the_limit_is_a_bucket_of_its_own():
    assert buckets([1, 25, 1], 10) == [[0, 1], [2]]
    assert buckets([25, 1], 10) == [[0], [1]]


def test_buckets_cover_every_entry_once_in_order():
    sizes = [7, 0, 3, 9, 0, 0, 12, 1]  # zeros: buffers, which need no gather
    out = buckets(sizes, 8)
    assert [i for b in out for i in b] == list(range(len(sizes)))
    # each bucket is under the limit before its last entry
    assert all(sum(sizes[i] for i in b[:-1]) < 8 for b in out)
    assert buckets([], 8) == []
