"""The weight-sync check without the real stack: the probe, the comparison, the driver's bookkeeping and the
engine wrapper that keeps the probe's outputs out of the decode loop. The corrupted load on the real stack is in
tests/test_weight_sync.py."""

import math
from types import SimpleNamespace

import pytest

from actors import weight_probe_requests
from actors.weight_probe_requests import ProbingEngine
from protocols.config import ConfigError, load_config
from protocols.weight_probe import build_weight_probe, check_probe_fits, probe_gap, run_probe
from weights.sync_check import WeightCheck, WeightSyncMismatch


def test_probe_is_the_same_in_every_process_and_spread_over_the_vocabulary():
    a = build_weight_probe(151_936, sequences=4, prompt_tokens=16, response_tokens=16, seed=0)
    b = build_weight_probe(151_936, sequences=4, prompt_tokens=16, response_tokens=16, seed=0)
    assert a == b and a.digest == b.digest
    assert [len(p) for p in a.prompt_ids] == [16] * 4 and [len(r) for r in a.response_ids] == [16] * 4
    ids = {t for seq in (*a.prompt_ids, *a.response_ids) for t in seq}
    assert all(0 <= t < 151_936 for t in ids) and len(ids) > 100  # 128 draws, hardly any repeated
    assert build_weight_probe(151_936, 4, 16, 16, seed=1).digest != a.digest
    assert a.longest == 32


def test_probe_longer_than_the_context_is_refused_naming_the_settings():
    probe = build_weight_probe(15, sequences=2, prompt_tokens=16, response_tokens=16)
    check_probe_fits(probe, 33)  # 32 tokens and the one the engine samples
    with pytest.raises(ValueError, match=r"verify_prompt_tokens \+ weight_sync.verify_response_tokens = 32 tokens "
                                         r"\(and the one token the engine samples\) do not fit the rollout engine's "
                                         r"context of 32 tokens"):
        check_probe_fits(probe, 32)


def test_driver_refuses_a_probe_that_does_not_fit_the_engines_context():
    # 16 prompt + 8 response tokens of context; a 30-token probe cannot be scored, the default 4 + 12 can
    WeightCheck(load_config(None), vocab_size=15, context_tokens=24)
    cfg = load_config(None, ["data.max_prompt_tokens=16", "rollout.max_response_tokens=8",
                             "weight_sync.verify_prompt_tokens=20", "weight_sync.verify_response_tokens=10"])
    with pytest.raises(ValueError, match="do not fit the rollout engine's context of 24 tokens"):
        WeightCheck(cfg, vocab_size=15, context_tokens=24)


def test_gap_is_the_largest_absolute_difference_and_where_it_is():
    # |[-1, -2] - [-1.1, -2]| = [0.1, 0]; |[-3] - [-2.5]| = [0.5]: largest 0.5 at sequence 1, token 0; mean 0.2
    gap = probe_gap([[-1.0, -2.0], [-3.0]], [[-1.1, -2.0], [-2.5]])
    assert math.isclose(gap.max_gap, 0.5) and (gap.sequence, gap.token) == (1, 0)
    assert math.isclose(gap.mean_gap, 0.2)


def test_nan_log_prob_is_an_infinite_gap():
    assert probe_gap([[-1.0, float("nan")]], [[-1.0, -2.0]]).max_gap == math.inf


def test_probes_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="built different probes"):
        probe_gap([[-1.0, -2.0]], [[-1.0]])


def _check(*overrides: str) -> WeightCheck:
    cfg = load_config(None, ["weight_sync.verify_sequences=2", "weight_sync.verify_prompt_tokens=3",
                             "weight_sync.verify_response_tokens=2", *overrides])
    return WeightCheck(cfg, vocab_size=15, context_tokens=64)


def _result(check: WeightCheck, version: int, logprobs: list[list[float]]) -> dict:
    return {"version": version, "digest": check.probe.digest, "logprobs": logprobs}


def test_a_gap_above_the_tolerance_stops_the_run_naming_version_worker_gap_and_setting():
    check = _check()  # float32: tolerance 1e-3
    assert check.tolerance == 1e-3
    check.record_learner(3, [[-1.0, -2.0], [-0.5, -0.25]])
    check.compare(0, [_result(check, 3, [[-1.0, -2.0 + 1e-5], [-0.5, -0.25]])])  # 1e-5: passes
    assert check.metrics() == {"weights/verify_checks": 1.0, "weights/verify_max_gap": pytest.approx(1e-5)}
    with pytest.raises(WeightSyncMismatch) as err:
        check.compare(7, [_result(check, 3, [[-1.0, -2.0], [-0.5, -1.25]])])
    message = str(err.value)
    assert "policy version 3" in message and "rollout worker 7" in message and "up to 1 nats" in message
    assert "sequence 1, token 1" in message and "model.dtype=float32" in message
    assert "weight_sync.verify_tolerance" in message and "weight_sync.verify_every=0" in message


def test_each_result_is_compared_once_and_only_against_the_same_version():
    check = _check("weight_sync.verify_tolerance=0.1")
    check.record_learner(2, [[-1.0, -1.0], [-1.0, -1.0]])
    same = _result(check, 2, [[-1.0, -1.0], [-1.0, -1.0]])
    unknown = _result(check, 5, [[-9.0, -9.0], [-9.0, -9.0]])  # no learner log-probs for version 5: not compared
    # a worker reports its last results on every call: the second report compares nothing new
    assert len(check.compare(0, [same, unknown])) == 1
    assert check.compare(0, [same]) == []
    assert check.compare(1, [same]) != []  # another worker's load of the same version is its own check
    assert check.metrics()["weights/verify_checks"] == 2.0
    assert check.metrics() == {"weights/verify_checks": 2.0}  # no gap on a step that compared nothing


def test_a_probe_built_differently_is_named_as_such():
    check = _check()
    check.record_learner(1, [[-1.0, -1.0], [-1.0, -1.0]])
    with pytest.raises(RuntimeError, match="scored a different weight-sync probe"):
        check.compare(0, [{"version": 1, "digest": check.probe.digest + 1, "logprobs": [[-1.0, -1.0]] * 2}])


def test_bf16_runs_get_the_looser_default_tolerance():
    assert _check("model.dtype=bfloat16").tolerance == 0.5
    assert _check("model.dtype=bfloat16", "weight_sync.verify_tolerance=0.2").tolerance == 0.2


def test_checked_versions_are_the_multiples_of_verify_every():
    check = _check("weight_sync.verify_every=3")
    assert [v for v in range(1, 10) if check.due(v)] == [3, 6, 9]


def test_learner_batch_gives_every_data_parallel_group_samples():
    # 2 probe sequences over 3 groups: repeated to 3 rows; the first 2 are the probe's
    check = _check()
    batch = check.learner_batch(3)
    assert batch.num_samples == 3
    assert [tuple(p) for p in batch.prompt_ids] == [*check.probe.prompt_ids, check.probe.prompt_ids[0]]
    assert batch.response(1) == list(check.probe.response_ids[1])
    check.record_learner(1, [[0.0, 0.0]] * 3)
    assert len(check.learner_logprobs[1]) == 2


def test_verify_settings_are_validated_for_both_transports():
    cfg = load_config(None, ["weight_sync.type=collective", "weight_sync.verify_every=0"])
    assert cfg.weight_sync.verify_every == 0
    assert load_config(None).weight_sync.verify_every == 1
    with pytest.raises(ConfigError):
        load_config(None, ["weight_sync.verify_tolerance=0"])
    with pytest.raises(ConfigError):
        load_config(None, ["weight_sync.verify_every=-1"])


# --- the engine wrapper ---------------------------------------------------------------------------------------
class FakeEngine:
    """Outputs of the requests added, one step later; a probe request's prompt log-prob of token t is -t."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.queue: list[str] = []
        self.aborted: list[str] = []

    def add_request(self, request_id, prompt, params):
        self.added.append(request_id)
        self.queue.append((request_id, prompt["prompt_token_ids"]))

    def step(self):
        outs = []
        for request_id, ids in self.queue:
            rows = [None] + [{t: SimpleNamespace(logprob=-float(t))} for t in ids[1:]]
            outs.append(SimpleNamespace(request_id=request_id, finished=True, prompt_logprobs=rows))
        self.queue = []
        return outs

    def has_unfinished_requests(self):
        return bool(self.queue)

    def abort_request(self, ids):
        self.aborted.extend(ids)
        self.queue = [(r, p) for r, p in self.queue if r not in ids]


@pytest.fixture
def probing(monkeypatch):
    monkeypatch.setattr(weight_probe_requests, "probe_params", lambda: None)
    cfg = load_config(None, ["weight_sync.verify_sequences=2", "weight_sync.verify_prompt_tokens=3",
                             "weight_sync.verify_response_tokens=2"])
    return ProbingEngine(FakeEngine(), run_probe(cfg, 15))


def test_probe_outputs_stay_out_of_the_decode_loop(probing):
    probing.start(4)
    probing.add_request("g0/0", {"prompt_token_ids": [1, 2]}, None)
    outs = probing.step()
    assert [o.request_id for o in outs] == ["g0/0"]  # the loop sees only its own request
    (result,) = probing.results
    probe = probing.probe
    assert result["version"] == 4 and result["digest"] == probe.digest
    assert result["logprobs"] == [[-float(t) for t in r] for r in probe.response_ids]


def test_a_probe_whose_weights_changed_before_it_was_scored_is_dropped(probing):
    probing.start(4)
    probing.start(5)  # version 5 loaded before the engine stepped: the version-4 probe would mix both
    assert probing.dropped == 1 and set(probing.engine.aborted) == {"weight-probe/4/0", "weight-probe/4/1"}
    probing.finish()
    assert [r["version"] for r in probing.results] == [5]
