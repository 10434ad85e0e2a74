"""vLLM's prefix cache, salted per weight version (rollout.prefix_caching).

A request whose prompt starts with whole KV blocks an earlier request computed skips their prefill: a group's
samples share their prompt, and a session's later calls share its history (gateway/). vLLM hashes each block with
the request's `cache_salt`, so salting every request with the version of the weights in the engine means KV
computed under older weights is never reused; a weight load, an adapter replaced in place under the same name,
needs no flush, and requests in flight keep the blocks they hold. Requests that ask for prompt log-probs (the
weight-sync probe, sequence_logprobs) are never served from the cache by vLLM.
"""

from collections.abc import Callable
from typing import Any

GATEWAY_PREFIX = "gateway-call/"
"""Request ids of the session endpoint's calls (gateway/engine_bridge.py), counted apart."""


def cache_salt(version: int) -> str:
    """The salt of every request made under weights `version`."""
    return f"relayrl-weights-v{version}"


class SaltedRequests:
    """The engine as the decode loop and the probe see it (actors/decode_loop.py `Engine`): every request carries
    the salt of the weights loaded now (`version()`), and finished requests count the prompt tokens they asked
    for and those the cache served."""

    def __init__(self, engine: Any, version: Callable[[], int]) -> None:
        self.engine = engine
        self.version = version
        self.counts = {"prefill_tokens": 0, "cached_tokens": 0, "gateway_prefill_tokens": 0,
                       "gateway_cached_tokens": 0}
        """Over this engine's life: the prompt tokens of finished requests, and those served from the cache; the
        same for the session endpoint's calls alone."""

    def add_request(self, request_id: str, prompt: dict, params: Any) -> None:
        self.engine.add_request(request_id, {**prompt, "cache_salt": cache_salt(self.version())}, params)

    def step(self) -> list:
        outputs = self.engine.step()
        for out in outputs:
            if out.finished:
                self._count(out)
        return outputs

    def _count(self, out: Any) -> None:
        prompt, cached = len(out.prompt_token_ids or ()), out.num_cached_tokens or 0
        self.counts["prefill_tokens"] += prompt
        self.counts["cached_tokens"] += cached
        if out.request_id.startswith(GATEWAY_PREFIX):
            self.counts["gateway_prefill_tokens"] += prompt
            self.counts["gateway_cached_tokens"] += cached

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)


def salted(inputs: list[dict], salt: str | None) -> list[dict]:
    """`LLM.generate` inputs with `salt` (None: as they are, the cache off)."""
    return inputs if salt is None else [{**x, "cache_salt": salt} for x in inputs]
