"""Scoring tool-using samples: a verifier reads the model's final answer (the text after the last tool output),
and a verifier that asks for them (wants_tool_calls) also gets the sample's tool calls; single-turn samples are
scored as before."""

from pathlib import Path

import pytest

from protocols.reward import RewardConfig
from protocols.trajectory import Prompt, ToolCall, Trajectory, TrajectoryGroup
from rewards.registry import resolve_verifier
from rewards.scorer import Scorer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CALL = "<tool_call>calculator:6*7</tool_call>"
OUTPUT = "<tool_response>42</tool_response>"


@pytest.fixture(autouse=True)
def _fixtures_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def _prompt() -> Prompt:
    return Prompt(prompt_id="t/test/0", prompt_token_ids=[0], answer="42")


def _multi_turn(final: str) -> Trajectory:
    # tokens: 3 model tokens (the call), 2 tool tokens (the response), then one token per final character
    text = CALL + OUTPUT + final
    n = 3 + 2 + len(final)
    call = ToolCall(name="calculator", arguments="6*7", output="42", output_start=3, output_tokens=2,
                    text_end=len(CALL + OUTPUT))
    return Trajectory(group_id="g", sample_index=0, prompt=_prompt(), response_token_ids=list(range(n)),
                      behavior_logprobs=[-0.5] * n, token_versions=[0, 0, 0, -1, -1] + [0] * len(final),
                      finish_reason="stop", response_text=text, tool_calls=[call])


def _single_turn(text: str, index: int = 1) -> Trajectory:
    return Trajectory(group_id="g", sample_index=index, prompt=_prompt(), response_token_ids=[1, 2],
                      behavior_logprobs=[-0.1, -0.2], token_versions=[0, 0], finish_reason="stop", response_text=text)


def _score(verifier: str, trajectories: list[Trajectory]) -> TrajectoryGroup:
    scorer = Scorer(RewardConfig(verifier=verifier, num_processes=1))
    try:
        return scorer.score_group(TrajectoryGroup(group_id="g", trajectories=trajectories))
    finally:
        scorer.close()


def test_the_verifier_reads_the_final_answer_only():
    # `exact` compares the whole text it is given with "42": the final answer "42" is right, although the whole
    # response (call + tool output + answer) is not; a single-turn "42" scores as before, "41" is wrong.
    group = _score("relayrl_test_verifiers:exact", [_multi_turn("42"), _single_turn("42"), _single_turn("41", 2)])
    assert group.rewards == [1.0, 1.0, 0.0]


def test_the_tool_calls_reach_a_verifier_that_asks():
    group = _score("relayrl_test_verifiers:tool_names", [_multi_turn(" 42"), _single_turn("42")])
    first, second = group.trajectories
    # the multi-turn sample called a tool and answered 42; the single-turn one got an empty list
    assert (first.reward, first.result.info["calls"], first.result.info["seen"]) == (1.0, ["calculator"], " 42")
    assert (second.reward, second.result.info["calls"]) == (0.0, [])


def test_a_batched_verifier_gets_one_list_per_response():
    group = _score("relayrl_test_verifiers:tool_counts", [_multi_turn("42"), _single_turn("42")])
    assert group.rewards == [1.0, 0.0]


def test_the_flag_is_read_from_an_imported_function_and_off_by_default():
    assert resolve_verifier("relayrl_test_verifiers:tool_names").wants_tool_calls
    assert not resolve_verifier("relayrl_test_verifiers:exact").wants_tool_calls
    assert not resolve_verifier("gsm8k").wants_tool_calls
