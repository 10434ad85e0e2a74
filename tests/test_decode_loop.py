"""The rollout worker's decode loop (actors/decode_loop.py) driven by a scripted stand-in for vLLM's engine."""

from types import SimpleNamespace

import pytest

from actors.decode_loop import FINISHED, Continue, DecodeLoop
from protocols.trajectory import Prompt


class ScriptedEngine:
    """Each request samples the tokens its script gives, `per_step` a step, with log-prob -token/10; it ends
    with finish_reason `stop`, or `length` where the script is longer than max_tokens. Its text is each token's
    `piece` (default `<id>`). tests/test_agent_loop.py drives it too."""

    def __init__(self, scripts: dict[str, list[int]], per_step: int = 2, piece=lambda t: f"<{t}>") -> None:
        self.scripts = scripts
        self.piece = piece
        self.per_step = per_step
        self.live: dict[str, dict] = {}
        self.added: list[tuple[str, list[int], int]] = []  # (request id, prompt ids, max_tokens)

    def add_request(self, request_id, prompt, params):
        self.added.append((request_id, list(prompt["prompt_token_ids"]), params.max_tokens))
        script = self.scripts[request_id]
        self.live[request_id] = {"tokens": script[:params.max_tokens], "done": 0,
                                 "reason": "length" if len(script) > params.max_tokens else "stop"}

    def has_unfinished_requests(self):
        return bool(self.live)

    def abort_request(self, request_ids):
        for request_id in request_ids:
            self.live.pop(request_id)

    def step(self):
        outs = []
        for request_id, r in list(self.live.items()):
            r["done"] = min(len(r["tokens"]), r["done"] + self.per_step)
            tokens = r["tokens"][:r["done"]]
            finished = r["done"] == len(r["tokens"])
            completion = SimpleNamespace(
                token_ids=tokens, text="".join(self.piece(t) for t in tokens),
                logprobs=[{t: SimpleNamespace(logprob=-t / 10)} for t in tokens],
                finish_reason=r["reason"] if finished else None)
            outs.append(SimpleNamespace(request_id=request_id, finished=finished, outputs=[completion]))
            if finished:
                del self.live[request_id]
        return outs


def _params(sample, max_tokens):
    return SimpleNamespace(max_tokens=max_tokens)


PROMPT = Prompt(prompt_id="p", prompt_token_ids=[100, 101])


def test_single_turn_sample_ends_with_its_request_and_stamps_each_token_with_its_step_version():
    # 5 tokens, 2 per step: steps at versions 3, 3, 4 stream tokens [1, 2], [3, 4], [5]
    engine = ScriptedEngine({"g0/0": [1, 2, 3, 4, 5]})
    loop = DecodeLoop(engine, _params, samples_per_prompt=1, max_response_tokens=8, worker_id=7)
    loop.start_group("g0", PROMPT)
    assert loop.step(3) == [] and loop.step(3) == []
    (group,) = loop.step(4)
    t = group.trajectories[0]
    assert t.response_token_ids == [1, 2, 3, 4, 5] and t.token_versions == [3, 3, 3, 3, 4]
    assert t.behavior_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert t.finish_reason == "stop" and t.worker_id == 7 and loop.active == {}
    assert engine.added == [("g0/0", [100, 101], 8)]


def test_a_continued_sample_keeps_its_prefix_versions_logprobs_and_token_budget():
    # budget 8: the first request samples [1, 2, 3] (steps at versions 0, 0); a fake agent continues once, so the
    # second request starts from prompt + [1, 2, 3] with 8 - 3 = 5 tokens left and samples [4, 5, 6] (versions 1,
    # 2): the trajectory is the two segments joined, each token with the version and log-prob it was sampled at
    ended = []

    def continue_once(sample, output):
        ended.append((sample.requests_ended, list(sample.response_token_ids)))
        return sample.continue_here() if sample.requests_ended == 1 else FINISHED

    engine = ScriptedEngine({"g0/0": [1, 2, 3], "g0/0/1": [4, 5, 6]})
    loop = DecodeLoop(engine, _params, samples_per_prompt=1, max_response_tokens=8, worker_id=0,
                      on_request_end=continue_once)
    loop.start_group("g0", PROMPT)
    assert loop.step(0) == [] and loop.step(0) == []
    assert engine.added[1] == ("g0/0/1", [100, 101, 1, 2, 3], 5)
    assert loop.step(1) == []
    (group,) = loop.step(2)
    t = group.trajectories[0]
    assert ended == [(1, [1, 2, 3]), (2, [1, 2, 3, 4, 5, 6])]
    assert t.response_token_ids == [1, 2, 3, 4, 5, 6]
    assert t.token_versions == [0, 0, 0, 1, 1, 2]
    assert t.behavior_logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])
    assert t.response_text == "<1><2><3><4><5><6>" and t.finish_reason == "stop"


def test_a_continuation_truncated_by_the_remaining_budget_is_marked_length():
    # budget 4: 3 tokens in the first request leave 1 for the second, whose script wants 3
    engine = ScriptedEngine({"g0/0": [1, 2, 3], "g0/0/1": [4, 5, 6]}, per_step=4)
    loop = DecodeLoop(engine, _params, 1, 4, 0,
                      on_request_end=lambda s, o: s.continue_here() if s.requests_ended == 1 else FINISHED)
    loop.start_group("g0", PROMPT)
    assert loop.step(0) == []
    (group,) = loop.step(0)
    assert group.trajectories[0].response_token_ids == [1, 2, 3, 4]
    assert group.trajectories[0].finish_reason == "length"


def test_a_continuation_must_start_from_the_exact_prefix_within_the_budget():
    engine = ScriptedEngine({"g0/0": [1, 2]}, per_step=4)
    loop = DecodeLoop(engine, _params, 1, 4, 0, on_request_end=lambda s, o: Continue([100, 101, 9], 2))
    loop.start_group("g0", PROMPT)
    with pytest.raises(ValueError, match="exact prefix"):
        loop.step(0)
    engine = ScriptedEngine({"g0/0": [1, 2]}, per_step=4)
    loop = DecodeLoop(engine, _params, 1, 4, 0, on_request_end=lambda s, o: Continue(s.prefix_ids, 3))
    loop.start_group("g0", PROMPT)
    with pytest.raises(ValueError, match="max_tokens=3"):
        loop.step(0)


def test_a_group_finishes_when_its_last_sample_does_and_abort_forgets_the_rest():
    engine = ScriptedEngine({"g0/0": [1], "g0/1": [1, 2, 3], "g1/0": [5, 6, 7, 8, 9], "g1/1": [8, 9, 10]})
    loop = DecodeLoop(engine, _params, samples_per_prompt=2, max_response_tokens=8, worker_id=0)
    loop.start_group("g0", PROMPT)
    loop.start_group("g1", PROMPT)
    assert loop.step(0) == []
    (group,) = loop.step(0)
    assert group.group_id == "g0" and [t.sample_index for t in group.trajectories] == [0, 1]
    assert loop.abort() == ["g1"] and engine.live == {} and loop.requests == {}


def test_a_first_request_keeps_the_single_turn_seed_and_a_continuation_draws_its_own():
    # the seed of sample i of group g is crc32("<train.seed>/g/i"), as before the loop could continue a sample
    import zlib

    from actors.decode_loop import SampleInFlight
    from actors.rollout_worker import RolloutWorker
    from protocols.config import RunConfig

    worker = SimpleNamespace(cfg=RunConfig())
    sample = SampleInFlight("g3", 1, PROMPT, max_response_tokens=16)
    first = RolloutWorker._sampling_params(worker, sample, 16)
    assert first.seed == zlib.crc32(f"{worker.cfg.train.seed}/g3/1".encode()) & 0x7FFFFFFF and first.max_tokens == 16
    sample.requests_ended = 1
    assert RolloutWorker._sampling_params(worker, sample, 5).seed != first.seed
