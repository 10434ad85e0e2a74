"""Reading a model turn's tool call (tagged, `NAME:ARGUMENTS` or JSON; malformed ones named), rendering a tool's
output as the segment the model reads next (cut at tools.max_output_tokens, tokenized once) with the demo's real
character tokenizer, and the `tools/*` metrics of a batch."""

import pytest

from demos.arithmetic_model import build_tokenizer
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt, ToolCall, Trajectory
from rewards.tool_calls import (MAX_CALL_CHARS, MAX_JSON_DEPTH, MalformedCall, ParsedCall, parse_call, render_output,
                                stop_strings, tool_counts, tool_metrics)

CFG = ToolsConfig(builtin=["calculator", "python"])


def test_a_turn_that_does_not_end_at_a_call_is_a_plain_answer():
    assert parse_call("The answer is 42.", CFG) is None
    # a call in the middle of the turn is not where the turn stopped: still a plain answer
    assert parse_call("<tool_call>calculator:1+1</tool_call> so 2", CFG) is None
    assert parse_call("", CFG) is None


def test_name_colon_arguments():
    turn = "I need 123*4567. <tool_call>calculator:123*4567</tool_call>"
    assert parse_call(turn, CFG) == ParsedCall("calculator", "123*4567")
    # spaces around the name and the arguments are dropped
    assert parse_call("<tool_call> calculator : 2 + 3 \n</tool_call>", CFG) == ParsedCall("calculator", "2 + 3")


def test_colons_in_the_arguments_stay_there():
    # split at the first colon only: a program with a dict and a slice keeps its colons
    turn = "<tool_call>python:\nd = {'a': 1}\nprint(d['a'], 'x:y'[0:1])\n</tool_call>"
    assert parse_call(turn, CFG) == ParsedCall("python", "d = {'a': 1}\nprint(d['a'], 'x:y'[0:1])")


def test_the_last_call_start_opens_the_call():
    # an earlier (unclosed) call_start in the turn's text is not part of the call
    turn = "thinking <tool_call> hmm. <tool_call>calculator:7*6</tool_call>"
    assert parse_call(turn, CFG) == ParsedCall("calculator", "7*6")


def test_json_body():
    turn = '<tool_call>{"name": "calculator", "arguments": "12*12"}</tool_call>'
    assert parse_call(turn, CFG) == ParsedCall("calculator", "12*12")
    # Hermes/Qwen style: the arguments an object; one string value is the argument text
    turn = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    assert parse_call(turn, CFG) == ParsedCall("python", "print(1)")
    # any other arguments are handed over as their JSON text; none at all is empty text
    turn = '<tool_call>{"name": "search", "arguments": {"q": "x", "k": 3}}</tool_call>'
    assert parse_call(turn, CFG) == ParsedCall("search", '{"q": "x", "k": 3}')
    assert parse_call('<tool_call>{"name": "now"}</tool_call>', CFG) == ParsedCall("now", "")


@pytest.mark.parametrize(("turn", "reason"), [
    ("calculator:1+1</tool_call>", "no '<tool_call>' before it"),
    ("<tool_call>   </tool_call>", "empty call"),
    ("<tool_call>123*456</tool_call>", "no `:` after the tool name"),
    ("<tool_call>print('a:b')</tool_call>", "is not a word"),
    ("<tool_call>:1+1</tool_call>", "is not a word"),
    ('<tool_call>{"name": "calculator", "arguments": </tool_call>', "bad JSON"),
    ('<tool_call>{"arguments": "1+1"}</tool_call>', "`name` None is not a word"),
    ('<tool_call>{"name": ""}</tool_call>', "is not a word"),
    ('<tool_call>{"name": ["calculator"]}</tool_call>', "is not a word"),
])  # fmt: skip
def test_malformed_calls_say_why(turn, reason):
    parsed = parse_call(turn, CFG)
    assert isinstance(parsed, MalformedCall)
    assert reason in parsed.reason


def test_a_json_call_nested_1000_deep_is_malformed_not_a_recursion_error():
    # 1000 `[` in the arguments plus the call's own `{`: 1001 levels, over MAX_JSON_DEPTH = 64
    turn = '<tool_call>{"name": "python", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"
    assert parse_call(turn, CFG) == MalformedCall(f"JSON call nested 1001 levels deep; at most {MAX_JSON_DEPTH}")


def test_a_json_call_at_the_depth_limit_is_read():
    # the call's `{` and 63 `[`: 64 levels, exactly MAX_JSON_DEPTH
    turn = '<tool_call>{"name": "f", "arguments": ' + "[" * 63 + "]" * 63 + "}</tool_call>"
    assert parse_call(turn, CFG) == ParsedCall("f", "[" * 63 + "]" * 63)


def test_brackets_inside_json_strings_are_not_nesting():
    # 100 `[` inside a string (with an escaped quote) are text, not depth: the call is 1 level deep
    code = "[" * 100 + '\\"'  # ends in an escaped quote
    turn = '<tool_call>{"name": "python", "arguments": "' + code + '"}</tool_call>'
    assert parse_call(turn, CFG) == ParsedCall("python", "[" * 100 + '"')


def test_a_100000_deep_call_is_refused_by_its_size():
    # 100,000 `{` and as many `}`: 200,000 characters, over MAX_CALL_CHARS = 100,000, refused unread
    turn = "<tool_call>" + "{" * 100_000 + "}" * 100_000 + "</tool_call>"
    assert parse_call(turn, CFG) == MalformedCall(f"call of 200000 characters; a call has at most {MAX_CALL_CHARS}")


def test_a_json_number_past_the_int_digit_limit_is_malformed():
    # json.loads raises ValueError (not JSONDecodeError) for a 5000-digit integer: a malformed call all the same
    turn = '<tool_call>{"name": "calculator", "arguments": ' + "1" * 5000 + "}</tool_call>"
    parsed = parse_call(turn, CFG)
    assert isinstance(parsed, MalformedCall)
    assert "more than 4300 digits" in parsed.reason


def test_a_sample_the_agent_loop_marked_malformed_counts_once_without_parsing_its_text_again():
    # the count reads the agent loop's verdict (Trajectory.malformed_call), not the text: a text that would
    # parse as a malformed call counts 0 unless marked, and a marked sample counts 1 whatever its text
    deep = '<tool_call>{"name": "python", "arguments": ' + "[" * 1000 + "]" * 1000 + "}</tool_call>"
    assert tool_counts([_traj(0, deep, 2, None, malformed=True)])["malformed_calls"] == 1
    assert tool_counts([_traj(0, deep, 2, None)])["malformed_calls"] == 0


def test_only_a_body_starting_with_a_brace_is_read_as_json():
    # `[1, 2]` is neither a JSON object nor NAME:ARGUMENTS
    assert parse_call("<tool_call>[1, 2]</tool_call>", CFG) == MalformedCall("no `:` after the tool name in '[1, 2]'")


def test_an_unknown_name_is_well_formed():
    # the ToolBox answers it with `unknown_tool`; parsing does not know the tools
    assert parse_call("<tool_call>weather:Paris</tool_call>", CFG) == ParsedCall("weather", "Paris")


def test_custom_tags_and_stop_strings():
    cfg = ToolsConfig(builtin=["calculator"], call_start="[[", call_end="]]")
    assert stop_strings(cfg) == ["]]"]
    assert stop_strings(CFG) == ["</tool_call>"]
    assert parse_call("so [[calculator:2**10]]", cfg) == ParsedCall("calculator", "2**10")
    assert parse_call("<tool_call>calculator:1</tool_call>", cfg) is None


# ----- rendering ------------------------------------------------------------------------------------------------
class _CountingTokenizer:
    """The real tokenizer, recording every text it encodes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.encoded: list[str] = []

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        self.encoded.append(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    # The demo's character tokenizer: one token per digit, `+`, `=` (and BOS in front when special tokens are on).
    return build_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))


def _ids(tokenizer, chars: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(chars))


def test_output_within_the_cap_is_wrapped_and_tokenized_once(char_tokenizer):
    cfg = ToolsConfig(builtin=["calculator"], output_template="={output}=", max_output_tokens=8)
    tok = _CountingTokenizer(char_tokenizer)
    rendered = render_output("561741", cfg, tok)
    assert rendered.text == "=561741="
    assert rendered.output == "561741" and not rendered.truncated
    # 8 tokens, one per character, no BOS in front
    assert rendered.token_ids == _ids(char_tokenizer, "=561741=")
    # the output alone (to measure it), then the whole rendered text once
    assert tok.encoded == ["561741", "=561741="]


def test_output_over_the_cap_is_cut_and_flagged(char_tokenizer):
    # 9 digits, cap 4: the first 4 tokens "1234" are kept, then wrapped: 6 tokens
    cfg = ToolsConfig(builtin=["calculator"], output_template="={output}+", max_output_tokens=4)
    rendered = render_output("123456789", cfg, char_tokenizer)
    assert rendered.truncated
    assert rendered.output == "1234"
    assert rendered.text == "=1234+"
    assert rendered.token_ids == _ids(char_tokenizer, "=1234+")


def test_a_long_output_is_cut_from_its_head_alone(char_tokenizer):
    # 95,000 lines of "1234567890" (a program printing about a MiB): the first 64 tokens are the first 64 digits
    # (newlines are dropped by this tokenizer), read from the first 1,024 characters only
    cfg = ToolsConfig(builtin=["python"], output_template="{output}", max_output_tokens=64)
    tok = _CountingTokenizer(char_tokenizer)
    rendered = render_output("1234567890\n" * 95_000, cfg, tok)
    assert rendered.truncated
    assert rendered.output == "1234567890" * 6 + "1234"
    assert [len(text) for text in tok.encoded] == [1024, 64]


def test_output_exactly_at_the_cap_is_not_truncated(char_tokenizer):
    cfg = ToolsConfig(builtin=["calculator"], output_template="{output}", max_output_tokens=3)
    rendered = render_output("123", cfg, char_tokenizer)
    assert (rendered.truncated, rendered.token_ids) == (False, _ids(char_tokenizer, "123"))


def test_template_braces_other_than_output_are_literal(char_tokenizer):
    cfg = ToolsConfig(builtin=["calculator"], output_template="{{{output}}} {x}", max_output_tokens=8)
    assert render_output("7", cfg, char_tokenizer).text == "{{7}} {x}"


def test_default_template_renders_the_tags(char_tokenizer):
    rendered = render_output("42", CFG, char_tokenizer)
    assert rendered.text == "<tool_response>42</tool_response>"
    assert len(rendered.token_ids) == len(char_tokenizer.encode(rendered.text, add_special_tokens=False))


# ----- metrics --------------------------------------------------------------------------------------------------
def _traj(index: int, text: str, n_tokens: int, calls: list[ToolCall] | None, finish: str = "stop",
          malformed: bool = False) -> Trajectory:
    versions = [0] * n_tokens
    for call in calls or []:
        versions[call.output_start: call.output_start + call.output_tokens] = [-1] * call.output_tokens
    return Trajectory(group_id="g", sample_index=index, prompt=Prompt(prompt_id="p", prompt_token_ids=[0]),
                      response_token_ids=[5] * n_tokens, behavior_logprobs=[0.0] * n_tokens, token_versions=versions,
                      finish_reason=finish, response_text=text, tool_calls=calls, malformed_call=malformed)


def _call(start: int, tokens: int, text_end: int, error: str = "", seconds: float = 0.0,
          truncated: bool = False) -> ToolCall:
    return ToolCall(name="calculator", arguments="1+1", output="2", error=error, seconds=seconds,
                    output_truncated=truncated, output_start=start, output_tokens=tokens, text_end=text_end)


def test_tool_metrics_of_a_batch():
    call = "<tool_call>calculator:1+1</tool_call>"
    out = "<tool_response>2</tool_response>"
    batch = [
        # two calls (0.5 s and 1.5 s, the second truncated and an exception), 20 tokens of which 4 + 6 are tool's
        _traj(0, call + out + call + out + "2", 20, [_call(3, 4, 70, seconds=0.5),
                                                     _call(10, 6, 140, "exception", 1.5, truncated=True)]),
        # one call that timed out (1 s), then stopped at max_turns while calling again; 10 tokens, 2 tool's
        _traj(1, call + out + call, 10, [_call(3, 2, 70, "timeout", 1.0)], finish="max_turns"),
        # no call: a plain answer of 5 tokens
        _traj(2, "2", 5, None),
        # a malformed call (no name): the sample ended there as a plain answer; 5 tokens
        _traj(3, "<tool_call>1+1</tool_call>", 5, None, malformed=True),
    ]
    metrics = tool_metrics(tool_counts(batch))
    assert metrics == {
        "tools/turns_per_sample": (3 + 2 + 1 + 1) / 4,
        "tools/calls_per_sample": 3 / 4,
        "tools/call_rate": 2 / 4,
        "tools/errors_exception": 1.0,
        "tools/errors_timeout": 1.0,
        "tools/errors_unknown_tool": 0.0,
        "tools/seconds_mean": (0.5 + 1.5 + 1.0) / 3,
        "tools/token_share": (4 + 6 + 2) / (20 + 10 + 5 + 5),
        "tools/truncated_outputs": 1.0,
        "tools/malformed_calls": 1.0,
        "tools/max_turns_share": 1 / 4,
    }


def test_tool_counts_add_over_steps():
    plain = [_traj(0, "2", 5, None)]
    one_call = [_traj(0, "<tool_call>calculator:1+1</tool_call><tool_response>2</tool_response>2", 10,
                      [_call(3, 4, 70, seconds=2.0)])]
    total = tool_counts(plain) + tool_counts(one_call)
    metrics = tool_metrics(total)
    # 2 samples, 1 call: 0.5 calls per sample, turns (1 + 2) / 2, tool tokens 4 of 15
    assert (metrics["tools/calls_per_sample"], metrics["tools/turns_per_sample"]) == (0.5, 1.5)
    assert metrics["tools/token_share"] == 4 / 15
    assert tool_metrics(tool_counts([]))["tools/calls_per_sample"] == 0.0


def test_tool_metric_names_are_in_a_documented_section():
    from protocols.metrics import unknown_names

    assert unknown_names(tool_metrics(tool_counts([_traj(0, "2", 5, None)]))) == []


def test_an_unterminated_string_is_read_to_the_end_once():
    from rewards.tool_calls import json_depth

    # brackets before the string nest; inside it (terminated or not) they do not
    assert json_depth('{"a": [1, "x]]"]}') == 2 and json_depth('{"a": [1, "x [[[') == 2
    # 49,990 escaped quotes in one unterminated string: a search from every quote to the end would be quadratic
    # (a minute for this text); read once, it is one string, and the decoder refuses the call as bad JSON
    assert json_depth('\\"' * 49_990) == 0
    call = parse_call("<tool_call>{" + '\\"' * 49_990 + "</tool_call>", ToolsConfig(builtin=["calculator"]))
    assert isinstance(call, MalformedCall) and call.reason.startswith("bad JSON")
