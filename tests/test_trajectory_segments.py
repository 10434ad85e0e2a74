"""A multi-turn trajectory's record: model and tool segments stored flat, with the loss mask, versions and
final answer read from where its tool calls lie."""

import pickle

import pytest

from actors.decode_loop import SampleInFlight
from protocols.config import RunConfig
from protocols.tools import ToolsConfig
from protocols.training_batch import TrainingBatch
from protocols.trajectory import Prompt, Trajectory


def _multi_turn() -> Trajectory:
    # model turn 1 sampled [5, 6] at version 3; the tool's output [9, 9, 9] is appended as context; model turn 2
    # sampled [7, 2] at version 4 (a weight update landed while the tool ran).
    sample = SampleInFlight("g", 0, Prompt(prompt_id="p", prompt_token_ids=[1, 4]), max_response_tokens=16)
    sample.response_token_ids += [5, 6]
    sample.behavior_logprobs += [-0.5, -0.25]
    sample.token_versions += [3, 3]
    sample.response_text += "<c>2*3</c>"
    call = sample.append_tool_output([9, 9, 9], "<o>6</o>", name="calculator", arguments="2*3", output="6",
                                     seconds=0.01)
    sample.response_token_ids += [7, 2]
    sample.behavior_logprobs += [-0.125, -1.0]
    sample.token_versions += [4, 4]
    sample.response_text += "6"
    assert (call.output_start, call.output_tokens, call.text_end) == (2, 3, len("<c>2*3</c><o>6</o>"))
    return Trajectory(group_id="g", sample_index=0, prompt=sample.prompt,
                      response_token_ids=sample.response_token_ids, behavior_logprobs=sample.behavior_logprobs,
                      token_versions=sample.token_versions, response_text=sample.response_text,
                      finish_reason="stop", tool_calls=sample.tool_calls)


def test_segments_mask_and_versions_of_a_multi_turn_response():
    t = _multi_turn()
    assert t.response_token_ids == [5, 6, 9, 9, 9, 7, 2]
    assert t.loss_mask == [True, True, False, False, False, True, True]
    assert [(s.kind, s.token_ids) for s in t.segments] == [("model", [5, 6]), ("tool", [9, 9, 9]), ("model", [7, 2])]
    assert t.segments[1].behavior_logprobs is None and t.segments[2].token_versions == [4, 4]
    # tool tokens have no version: staleness is measured from the oldest sampled token (3), not from -1
    assert (t.min_version, t.max_version) == t.version_span == (3, 4)
    assert t.model_copy(update={"response_token_ids": [], "behavior_logprobs": [], "token_versions": [],
                                "tool_calls": None}).version_span == (-1, -1)  # no sampled token
    assert t.final_text == "6" and t.num_turns == 2 and not t.truncated


def test_training_batch_trains_only_the_sampled_tokens():
    batch = TrainingBatch.from_trajectories([_multi_turn()])
    assert batch.response_ids[0].tolist() == [5, 6, 9, 9, 9, 7, 2]
    assert batch.loss_mask[0].tolist() == [True, True, False, False, False, True, True]
    assert batch.behavior_logprobs[0].tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -0.125, -1.0]


def test_single_turn_record_is_unchanged_on_the_wire():
    single = Trajectory(group_id="g", sample_index=0, prompt=Prompt(prompt_id="p", prompt_token_ids=[1]),
                        response_token_ids=[5, 2], behavior_logprobs=[-0.5, -0.1], token_versions=[0, 0],
                        finish_reason="stop")
    assert single.tool_calls is None and single.loss_mask == [True, True] and single.final_text == ""
    # a single-turn record carries no tool field on disk (JSON) or on the wire (pickle, as Ray sends it)
    assert "tool_calls" not in single.model_dump_json()
    assert b"tool_calls" not in pickle.dumps(single)
    assert pickle.loads(pickle.dumps(single)) == single and pickle.loads(pickle.dumps(single)).tool_calls is None
    multi = _multi_turn()
    assert Trajectory.model_validate_json(multi.model_dump_json()) == multi == pickle.loads(pickle.dumps(multi))


def test_max_turns_counts_as_truncated():
    t = _multi_turn().model_copy(update={"finish_reason": "max_turns"})
    assert t.truncated and TrainingBatch.from_trajectories([t]).truncated.tolist() == [True]


def test_tools_config_rules():
    assert not RunConfig().tools.enabled
    cfg = ToolsConfig(builtin=["calculator"], custom={"search": "my_tools.search:run"})
    assert cfg.enabled and cfg.names == ["calculator", "search"]
    with pytest.raises(ValueError, match="module:function"):
        ToolsConfig(custom={"search": "my_tools.search"})
    with pytest.raises(ValueError, match="built-in"):
        ToolsConfig(custom={"python": "m:f"})
    with pytest.raises(ValueError, match="exactly once"):
        ToolsConfig(output_template="<o></o>")
