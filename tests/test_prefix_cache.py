"""actors/prefix_cache.py: every request carries the salt of the weights loaded when it was added, finished requests
count their prompt tokens and those the cache served (the session endpoint's calls apart), and rollout/* and
gateway/* turn the counts into hit rates. The real engine's cache: tests/test_session_endpoint.py."""

from types import SimpleNamespace

from actors.prefix_cache import GATEWAY_PREFIX, SaltedRequests, cache_salt, salted
from protocols.metrics import gateway_metrics, rollout_metrics


class Engine:
    """Records what is added; `step` returns the outputs a test queued."""

    def __init__(self) -> None:
        self.added: list[tuple[str, dict]] = []
        self.outputs: list = []

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, prompt))

    def step(self):
        outputs, self.outputs = self.outputs, []
        return outputs

    def has_unfinished_requests(self):
        return bool(self.outputs)

    def abort_request(self, request_ids):
        pass


def finished(request_id: str, prompt_len: int, cached: int, done: bool = True):
    return SimpleNamespace(request_id=request_id, prompt_token_ids=[0] * prompt_len, num_cached_tokens=cached,
                           finished=done)


def test_requests_carry_the_salt_of_the_weights_loaded_when_they_are_added():
    engine, version = Engine(), [3]
    requests = SaltedRequests(engine, lambda: version[0])
    requests.add_request("g/0", {"prompt_token_ids": [1, 2]}, None)
    version[0] = 4  # a weight load between two requests
    requests.add_request("g/1", {"prompt_token_ids": [1, 2]}, None)
    assert [p["cache_salt"] for _, p in engine.added] == [cache_salt(3), cache_salt(4)] != [cache_salt(3)] * 2
    assert engine.added[0][1]["prompt_token_ids"] == [1, 2]
    assert salted([{"prompt_token_ids": [1]}], None) == [{"prompt_token_ids": [1]}]  # the cache off: unsalted
    assert salted([{"prompt_token_ids": [1]}], "s") == [{"prompt_token_ids": [1], "cache_salt": "s"}]


def test_finished_requests_count_prefill_and_cache_hits_with_the_endpoints_apart():
    engine = Engine()
    requests = SaltedRequests(engine, lambda: 0)
    # a group's two samples (300-token prompt: the second finds 2 whole 128-token blocks cached), a session's call
    # (500 tokens, 384 cached), and a request still decoding (not counted yet)
    engine.outputs = [finished("g/0", 300, 0), finished("g/1", 300, 256), finished(f"{GATEWAY_PREFIX}1/0", 500, 384),
                      finished("g/2", 300, 256, done=False)]
    assert len(requests.step()) == 4
    assert requests.counts == {"prefill_tokens": 1100, "cached_tokens": 640, "gateway_prefill_tokens": 500,
                               "gateway_cached_tokens": 384}
    report = {"wall_s": 1.0, "generate_s": 1.0, "idle_s": 0.0, "tokens": 10, "sync_s": 0.0, **requests.counts,
              "gateway": {"sessions": 2, "calls": 3, "samples": 1, "sessions_rewarded": 1}}
    rollout = rollout_metrics([report])
    # 640 of 1,100 prompt tokens from the cache
    assert rollout["rollout/prefix_cache_hit_rate"] == 640 / 1100 and rollout["rollout/prefill_tokens_saved"] == 640
    gateway = gateway_metrics([report])
    # 384 tokens saved over 2 sessions; 384 of the endpoint's 500
    assert gateway["gateway/prefill_tokens_saved_per_session"] == 192.0
    assert gateway["gateway/prefix_cache_hit_rate"] == 384 / 500
