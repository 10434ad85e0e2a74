"""Model output read back by the code verifier: a function-call result (the JSON the program returned) that nests
past the decoder's recursion limit or holds a number past Python's int-from-text limit is a wrong answer, never an
exception. (The bounds of the other parsers are tested beside them: test_tool_calls, test_tools, test_math_verifier,
test_gsm8k_verifier.)"""

import pytest

from protocols.reward import CodeSandboxConfig
from rewards import code_sandbox
from rewards.code_sandbox import RunResult, run_test


@pytest.mark.parametrize("returned", [
    "[" * 100_000 + "]" * 100_000,   # 100,000 levels: json.loads raises RecursionError
    "1" * 5000,                      # 5000 digits: json.loads raises ValueError (the 4300-digit limit)
    "not json",                      # JSONDecodeError
])  # fmt: skip
def test_a_function_result_json_cannot_read_is_a_wrong_answer(monkeypatch, returned):
    def fake_run(code, cfg, stdin="", fn_name="", args=None, timeout_s=None):
        return RunResult(status="ok", stdout="", stderr="", result=returned, seconds=0.0)

    monkeypatch.setattr(code_sandbox, "run_in_sandbox", fake_run)
    test = {"fn_name": "f", "args": [], "output": [1]}
    assert run_test("def f(): ...", test, CodeSandboxConfig(), 1.0) == (False, "wrong_answer")

