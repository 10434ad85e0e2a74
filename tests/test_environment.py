"""OpenEnv-shaped environments as tools (tools.environment, rewards/environment.py): schemas from the methods'
signatures and docstrings, one instance per sample started with its prompt's row, calls dispatched as keyword
arguments, bad calls answered as error text, and the reward attribute read when the sample ends. The agent-loop
tests drive the real decode loop and agent loop with a scripted engine (tests/test_decode_loop.py) and Qwen2.5's
chat template."""

import json
import time

import pytest

from actors.agent_loop import AgentLoop
from actors.decode_loop import DecodeLoop
from demos.products_env import ProductsEnv
from protocols.reward import RewardConfig
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup
from protocols.data import DataConfig
from rewards.environment import Episode, environment_schemas, prompt_encoder, prompt_tools, tool_methods
from tests.test_decode_loop import ScriptedEngine, _params
from tests.tiny_chat_tokenizer import build_chat_tokenizer

TOOLS = ToolsConfig(environment="demos.products_env:ProductsEnv", call_format="hermes", max_turns=4,
                    max_output_tokens=8, timeout_s=2.0)
PROMPT = Prompt(prompt_id="products/train/0", prompt_token_ids=[1], prompt_text="12*3?", answer="36",
                metadata={"a": 12, "b": 3})


class Probe:
    """Records what it was started with; its tools misbehave on purpose."""

    def reset(self, **row):
        self.row = row
        self.reward = "not a number"
        return "an observation"

    def echo(self, text: str) -> str:
        """Return the text.

        Args:
            text: Any text.
        """
        return text

    def fail(self) -> str:
        """Raise."""
        raise RuntimeError("broken tool")

    def huge(self) -> str:
        """Return ten million characters."""
        return "x" * 10_000_000

    def sleep(self, seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"

    def _private(self) -> None:
        pass


def test_the_schemas_come_from_the_methods_signatures_and_docstrings():
    multiply, submit = environment_schemas(ProductsEnv)
    assert multiply["function"]["name"] == "multiply"
    assert multiply["function"]["description"] == "Multiply two integers."
    assert multiply["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "The first factor."},
        "b": {"type": "integer", "description": "The second factor."}}
    assert multiply["function"]["parameters"]["required"] == ["a", "b"]
    assert submit["function"]["parameters"]["required"] == ["answer"]
    assert tool_methods(Probe) == ["echo", "fail", "huge", "sleep"]  # reset and _private are not tools


def test_a_method_without_a_docstring_is_refused_naming_it():
    class NoDoc:
        def reset(self, **row):
            pass

        def act(self, x: int) -> str:
            return str(x)

    with pytest.raises(ValueError, match=r"NoDoc\.act cannot be offered as a tool"):
        environment_schemas(NoDoc)


def test_the_config_needs_a_module_class_name_and_only_hermes_prompts_get_the_schemas():
    assert prompt_tools(ToolsConfig(environment="demos.products_env:ProductsEnv")) is None
    with pytest.raises(ValueError, match="must be `module:ClassName`"):
        ToolsConfig(environment="ProductsEnv", call_format="hermes")
    assert TOOLS.enabled
    assert [s["function"]["name"] for s in prompt_tools(TOOLS)] == ["multiply", "submit"]


def test_reset_gets_the_prompts_row_and_calls_are_keyword_arguments():
    cfg = TOOLS.model_copy(update={"environment": "tests.test_environment:Probe"})
    episode = Episode(Probe, PROMPT, cfg)
    assert episode.instance.row == {"prompt": "12*3?", "answer": "36", "prompt_id": "products/train/0",
                                    "a": 12, "b": 3}
    assert episode.observation == "an observation"
    result = episode.call("echo", json.dumps({"text": "hi"}))
    assert (result.output, result.error) == ("hi", "")
    # the tagged format's argument text goes whole to a one-parameter method
    assert episode.call("echo", "12*34").output == "12*34"
    assert episode.call("echo", "7").output == "7" and episode.call("echo", "[1, 2]").output == "[1, 2]"
    # text nested too deep for JSON goes whole to a one-parameter tool, as any text that is not JSON
    assert episode.call("echo", "[" * 2000).output == "[" * 2000


@pytest.mark.parametrize("name, arguments, error, text", [
    ("nope", "{}", "unknown_tool", "unknown tool 'nope'; the tools are: echo, fail, huge, sleep"),
    ("echo", "{not json", "exception", "ValueError: the arguments are not a JSON object"),
    ("fail", "[1]", "exception", "TypeError: the arguments must be a JSON object, got list"),
    ("fail", "plain text", "exception", "ValueError: the arguments are not a JSON object"),
    ("echo", '{"text": "hi", "x": 1}', "exception", "TypeError: echo: got an unexpected keyword argument 'x'"),
    ("echo", "{}", "exception", "TypeError: echo: missing a required argument: 'text'"),
    ("fail", "{}", "exception", "RuntimeError: broken tool"),
    ("sleep", '{"seconds": 5}', "timeout", "TimeoutError: the tool ran past tools.timeout_s=0.2 s"),
    # nested past MAX_JSON_DEPTH=64: refused before the decoder, which would raise RecursionError at this depth
    ("fail", "[" * 2000, "exception", "ValueError: the arguments are not a JSON object (nested 2000 levels deep; "
                                      "at most 64)"),
    ("echo", '{"text":' * 5000, "exception", "ValueError: the arguments are not a JSON object (nested 5000"),
])
def test_a_bad_call_is_an_error_text_never_a_raise(name, arguments, error, text):
    episode = Episode(Probe, PROMPT, TOOLS.model_copy(update={"timeout_s": 0.2}))
    result = episode.call(name, arguments)
    assert result.error == error and result.output.startswith(text)


def test_a_wrong_argument_type_reaches_the_method_and_its_error_is_the_output():
    episode = Episode(ProductsEnv, PROMPT, TOOLS)
    result = episode.call("multiply", '{"a": "twelve", "b": 3}')
    assert result.error == "exception" and result.output.startswith("ValueError: invalid literal for int()")


def test_the_reward_is_the_attribute_and_a_bad_one_is_none():
    episode = Episode(ProductsEnv, PROMPT, TOOLS)
    assert episode.reward() == 0.0
    assert episode.call("submit", '{"answer": 36}').output == "correct"
    assert episode.call("submit", '{"answer": 1}').output == "already submitted"
    assert episode.reward() == 1.0
    assert Episode(Probe, PROMPT, TOOLS).reward() is None  # "not a number"
    missing = Episode(ProductsEnv, PROMPT, TOOLS.model_copy(update={"environment_reward": "score"}))
    assert missing.reward() is None

    class Broken:
        def reset(self, **row):
            raise KeyError("answer")

    broken = Episode(Broken, PROMPT, TOOLS)
    assert broken.reward() is None and broken.call("x", "{}").output.startswith("the environment could not start")


# ----- through the decode loop and the agent loop ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("qwen25"))


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def call(name, arguments):
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + '}\n</tool_call>'


def run(tok, scripts, tools=TOOLS, size=1, encode=None, engine_log=None):
    prompt_text = tok.apply_chat_template([{"role": "user", "content": "12*3?"}], tools=prompt_tools(tools),
                                          tokenize=False, add_generation_prompt=True)
    prompt = PROMPT.model_copy(update={"prompt_token_ids": ids(tok, prompt_text)})
    engine = ScriptedEngine(scripts, per_step=64, piece=lambda t: tok.decode([t], skip_special_tokens=True))
    if engine_log is not None:
        engine_log.append(engine)
    agent = AgentLoop(tools, RewardConfig(), tok, encode_prompt=encode)
    loop = DecodeLoop(engine, _params, size, 256, 0, on_request_end=agent)
    loop.start_group("g", prompt)
    groups = []
    deadline = time.monotonic() + 30
    while not groups and time.monotonic() < deadline:
        groups = loop.step(0)
    agent.close()
    return prompt, groups[0].trajectories, agent


def test_each_sample_has_its_own_episode_and_its_reward_lands_on_the_trajectory(tok):
    end = ids(tok, "<|im_end|>")
    # sample 0 multiplies then submits the right product (reward 1); sample 1 submits a wrong one (reward 0)
    scripts = {"g/0": ids(tok, call("multiply", {"a": 12, "b": 3})) + end,
               "g/0/1": ids(tok, call("submit", {"answer": 36})) + end, "g/0/2": ids(tok, "36") + end,
               "g/1": ids(tok, call("submit", {"answer": 35})) + end, "g/1/1": ids(tok, "35") + end}
    prompt, (t0, t1), agent = run(tok, scripts, size=2)
    assert '"name": "multiply"' in tok.decode(prompt.prompt_token_ids)  # the schemas are in the prompt
    assert [(c.name, c.output, c.error) for c in t0.tool_calls] == [("multiply", "36", ""), ("submit", "correct", "")]
    assert [(c.name, c.output) for c in t1.tool_calls] == [("submit", "wrong")]
    assert (t0.environment_reward, t1.environment_reward) == (1.0, 0.0)
    assert agent.counts["environment_episodes"] == 2 and agent.counts["environment_bad_rewards"] == 0
    assert agent.episodes == {}  # each ended episode is let go


def test_a_sample_without_calls_still_gets_its_reward_and_a_bad_one_is_counted_zero(tok):
    end = ids(tok, "<|im_end|>")
    tools = TOOLS.model_copy(update={"environment": "tests.test_environment:Probe"})
    _, (t,), agent = run(tok, {"g/0": ids(tok, "36") + end}, tools=tools)
    assert t.tool_calls is None and t.environment_reward == 0.0
    assert agent.counts["environment_bad_rewards"] == 1 and agent.counts["environment_observations_unshown"] == 1


def test_a_huge_output_is_cut_at_max_output_tokens(tok):
    end = ids(tok, "<|im_end|>")
    tools = TOOLS.model_copy(update={"environment": "tests.test_environment:Probe"})
    _, (t,), agent = run(tok, {"g/0": ids(tok, call("huge", {})) + end, "g/0/1": ids(tok, "done") + end},
                         tools=tools)
    (record,) = t.tool_calls
    assert record.output_truncated and len(ids(tok, record.output)) <= 8
    assert agent.counts["truncated_outputs"] == 1


def test_the_reward_worker_puts_the_environment_reward_in_place_of_the_verifiers():
    from rewards.scorer import Scorer

    traj = Trajectory(group_id="g", sample_index=0, prompt=PROMPT, response_token_ids=[5],
                      behavior_logprobs=[0.0], token_versions=[0], finish_reason="stop", response_text="35",
                      environment_reward=1.0)
    plain = traj.model_copy(update={"environment_reward": None})
    scorer = Scorer(RewardConfig(verifier="math", num_processes=1))
    try:
        scored = scorer.score_group(TrajectoryGroup(group_id="g", trajectories=[traj, plain]))
    finally:
        scorer.close()
    with_env, without = scored.trajectories
    # the verifier says 35 is wrong (0); the environment's 1.0 replaces it, the verifier's stays in result
    assert (with_env.reward, with_env.result.reward, with_env.result.correct) == (1.0, 0.0, False)
    assert with_env.result.info["environment_reward"] == 1.0
    assert without.reward == 0.0 and "environment_reward" not in without.result.info
    assert "environment_reward" not in plain.model_dump()  # records without an environment are unchanged


class Observed:
    """reset returns an observation for the product 12*3 and none for any other row."""

    def reset(self, **row):
        self.reward = 0.0
        return " Prices: 12 each." if row["a"] == 12 else None

    def submit(self, answer: int) -> str:
        """Submit.

        Args:
            answer: The product.
        """
        self.reward = float(answer == 36)
        return "ok"


def test_a_reset_observation_is_appended_to_the_user_message_and_the_engine_gets_that_prompt(tok):
    end = ids(tok, "<|im_end|>")
    tools = TOOLS.model_copy(update={"environment": "tests.test_environment:Observed"})
    log = []
    _, (t0, t1), agent = run(tok, {"g/0": ids(tok, "36") + end, "g/1": ids(tok, "35") + end}, tools=tools, size=2,
                             encode=prompt_encoder(DataConfig(max_prompt_tokens=4096), tools, tok), engine_log=log)
    # TRL's environment_factory: content + observation, then the template (with the environment's tools) as the
    # data loader renders it
    shown = ids(tok, tok.apply_chat_template([{"role": "user", "content": "12*3? Prices: 12 each."}],
                                             tools=prompt_tools(tools), tokenize=False, add_generation_prompt=True))
    assert [prompt for _, prompt, _ in log[0].added] == [shown, shown]  # each sample's own reset said it
    assert t0.prompt.prompt_token_ids == t1.prompt.prompt_token_ids == shown
    assert t0.prompt.prompt_text == "12*3? Prices: 12 each." and t0.prompt.answer == "36"
    assert agent.counts["environment_observations_shown"] == 2 and agent.counts["environment_observations_unshown"] == 0


def test_no_observation_keeps_the_prompt_and_one_past_max_prompt_tokens_is_counted_unshown(tok):
    end = ids(tok, "<|im_end|>")
    tools = TOOLS.model_copy(update={"environment": "tests.test_environment:Observed"})
    log = []
    prompt, (t,), agent = run(tok, {"g/0": ids(tok, "36") + end}, tools=tools, engine_log=log,
                              encode=prompt_encoder(DataConfig(max_prompt_tokens=8), tools, tok))
    assert log[0].added[0][1] == prompt.prompt_token_ids == t.prompt.prompt_token_ids  # the data loader's prompt
    assert agent.counts["environment_observations_unshown"] == 1 and agent.counts["environment_observations_shown"] == 0
    # (the byte-level test tokenizer's prompt with the tools' schemas is some 700 tokens, past 8 and under 4096)
    # a row whose reset says nothing: the data loader's prompt, nothing counted
    log.clear()
    original = PROMPT
    try:
        globals()["PROMPT"] = PROMPT.model_copy(update={"metadata": {"a": 11, "b": 3}})
        prompt, (t,), agent = run(tok, {"g/0": ids(tok, "33") + end}, tools=tools, engine_log=log,
                                  encode=prompt_encoder(DataConfig(max_prompt_tokens=4096), tools, tok))
    finally:
        globals()["PROMPT"] = original
    assert log[0].added[0][1] == prompt.prompt_token_ids == t.prompt.prompt_token_ids
    assert agent.counts["environment_observations_unshown"] == agent.counts["environment_observations_shown"] == 0
