"""Scorer: user verifiers by import path, timeouts, exceptions and crashes counted as errors without stalling,
hung processes replaced, batched verifiers, and the shaping composition."""

from pathlib import Path

import pytest

from protocols.reward import RewardConfig, ShapingConfig
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup, VerifierResult
from rewards.scorer import Scorer
from rewards.shaping import as_result, compose, length_fraction

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(autouse=True)
def _fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def _prompts(n: int, answer: str = "7") -> list[Prompt]:
    return [Prompt(prompt_id=f"t/test/{i}", prompt_token_ids=[0], answer=answer) for i in range(n)]


def _scorer(verifier: str, **kw) -> Scorer:
    return Scorer(RewardConfig(verifier=f"relayrl_test_verifiers:{verifier}", **kw))


def test_custom_float_verifier_by_import_path():
    scorer = _scorer("exact", num_processes=2)
    try:
        results = scorer.score(_prompts(4), ["7", "8", " 7 ", "seven"])
        # float 1.0 -> correct, 0.0 -> not
        assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0]
        assert [r.correct for r in results] == [True, False, True, False]
        assert scorer.metrics()["reward_worker/samples"] == 4
    finally:
        scorer.close()


def test_uncounted_scoring_leaves_the_training_metrics_alone():
    # held-out evaluation scores with count=False: results as usual, reward_worker/* counters untouched
    scorer = _scorer("exact")
    try:
        scorer.score(_prompts(2), ["7", "8"])
        held_out = scorer.score(_prompts(3), ["7", "7", "8"], count=False)
        assert [r.correct for r in held_out] == [True, True, False]
        metrics = scorer.metrics()
        # only the 2 counted samples, 1 of them correct: mean reward 1/2
        assert (metrics["reward_worker/samples"], metrics["reward_worker/reward_mean"]) == (2, 0.5)
    finally:
        scorer.close()


def test_slow_samples_time_out_while_the_others_score():
    scorer = _scorer("slow_when_asked", num_processes=2, timeout_s=0.5)
    try:
        results = scorer.score(_prompts(4), ["ok", "slow", "ok", "slow"])
        assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0]
        assert [r.error for r in results] == ["", "timeout", "", "timeout"]
        metrics = scorer.metrics()
        assert (metrics["reward_worker/error_timeout"], metrics["reward_worker/samples"]) == (2, 4)
        # the scorer keeps working afterwards, and counts restart from zero
        assert [r.reward for r in scorer.score(_prompts(2), ["ok", "ok"])] == [1.0, 1.0]
        assert scorer.metrics()["reward_worker/error_timeout"] == 0
    finally:
        scorer.close()


def test_a_hung_process_is_killed_and_replaced():
    # SIGALRM blocked: the soft timeout cannot fire, so the process is killed 0.5 + 2 s grace later
    scorer = _scorer("hang_when_asked", num_processes=1, timeout_s=0.5)
    try:
        results = scorer.score(_prompts(3), ["ok", "hang", "ok"])
        assert [r.reward for r in results] == [1.0, 0.0, 1.0]
        assert results[1].error == "timeout"
        metrics = scorer.metrics()
        assert (metrics["reward_worker/error_timeout"], metrics["reward_worker/process_restarts"]) == (1, 1)
    finally:
        scorer.close()


def test_exceptions_crashes_and_bad_returns_are_counted():
    scorer = _scorer("fail_when_asked", num_processes=1)
    try:
        results = scorer.score(_prompts(5), ["raise", "ok", "crash", "string", "ok"])
        assert [r.reward for r in results] == [0.0, 1.0, 0.0, 0.0, 1.0]
        assert [r.error for r in results] == ["exception", "", "crash", "exception", ""]
        assert "bad sample" in results[0].info["message"]
        metrics = scorer.metrics()
        assert (metrics["reward_worker/error_exception"], metrics["reward_worker/error_crash"]) == (2, 1)
    finally:
        scorer.close()


def test_info_json_cannot_hold_is_that_samples_exception_and_the_process_lives():
    scorer = _scorer("info_json_cannot_hold", num_processes=1)
    try:
        results = scorer.score(_prompts(4), ["ok", "deep", "digits", "fine"])
        assert [r.error for r in results] == ["", "exception", "exception", ""]
        assert [r.reward for r in results] == [1.0, 0.0, 0.0, 1.0]
        assert results[0].info["parsed"] == "ok" and results[3].info["parsed"] == "fine"
        assert "nests too deep" in results[1].info["message"]
        assert "4300 digits" in results[2].info["message"]
        metrics = scorer.metrics()
        assert metrics["reward_worker/error_exception"] == 2 and metrics["reward_worker/process_restarts"] == 0
    finally:
        scorer.close()


def test_batched_verifier_gets_the_batch():
    scorer = _scorer("count_chars", num_processes=1)
    try:
        results = scorer.score(_prompts(3), ["a", "abcde", "abcdefghij"])
        # lengths 1, 5, 10 over 10
        assert [r.reward for r in results] == [0.1, 0.5, 1.0]
        assert results[0].info["batch"] == 3
    finally:
        scorer.close()


def test_score_group_fills_reward_and_result_with_builtin_gsm8k():
    scorer = Scorer(RewardConfig(verifier="gsm8k"))
    prompt = _prompts(1, answer="#### 18")[0]
    group = TrajectoryGroup(
        group_id="g0",
        trajectories=[
            Trajectory(group_id="g0", sample_index=i, prompt=prompt, response_token_ids=[1, 2],
                       behavior_logprobs=[0.0, 0.0], token_versions=[0, 0], finish_reason="stop", response_text=text)
            for i, text in enumerate(["#### 18", "it is 17"])
        ],
    )
    try:
        scored = scorer.score_group(group)
        assert scored.rewards == [1.0, 0.0]
        assert scored.trajectories[0].result.info["extracted"] == "18"
    finally:
        scorer.close()


def test_unknown_verifier_fails_at_construction():
    with pytest.raises(ValueError, match="is not registered"):
        Scorer(RewardConfig(verifier="no_such_verifier"))


def test_compose_adds_format_and_subtracts_length_penalty():
    cfg = ShapingConfig(format_weight=0.2, format_regex=r"\\boxed\{", length_penalty_weight=0.5,
                        length_penalty_start_tokens=100, length_penalty_window_tokens=100)
    task = VerifierResult(reward=0.0, correct=False, info={"extracted": "3"})
    # task 0, format 1, 150 tokens -> (150 - 100) / 100 = 0.5 of the 0.5 weight: 0 + 0.2 - 0.25 = -0.05
    shaped = compose(task, r"\boxed{3}", 150, cfg)
    assert shaped.reward == pytest.approx(-0.05)
    assert shaped.correct is False  # follows the task reward alone
    assert shaped.info == {"extracted": "3", "task_reward": 0.0, "format_reward": 1.0, "length_penalty": 0.25}


def test_length_fraction_is_zero_then_linear_then_one():
    # start 100, window 50: 90 -> 0, 125 -> 0.5, 200 -> 1
    assert [length_fraction(n, 100, 50) for n in (90, 125, 200)] == [0.0, 0.5, 1.0]


def test_format_weight_needs_a_pattern():
    with pytest.raises(ValueError, match="needs reward.shaping.format_regex"):
        ShapingConfig(format_weight=0.1)


def test_as_result_wraps_numbers_and_refuses_other_types():
    assert as_result(True, "v") == VerifierResult(reward=1.0, correct=True)
    assert as_result(0.5, "v").correct is False
    with pytest.raises(TypeError, match="returned str"):
        as_result("yes", "v")
