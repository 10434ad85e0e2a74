"""The token contract of tool-using rollouts against a real vLLM engine (a rollout worker's, in-process): the
learner's response ids are the engine's sampled ids plus the tool tokens, log-probs and versions sit on model
tokens only, a sample waiting on a tool holds no engine slot, and a weight update between turns stamps the later
turn with the new version. The evaluation path runs the same agent loop.

A random tiny model rarely writes a call by itself, so its vocabulary has two whole calls as single tokens, and
the first turn's sampling parameters bias them up (and EOS and the bare closing tag down): each sample then
writes some random tokens and a call. One call token ends exactly at the stop string; the other has a character
after it (`...</tool_call>7`), so the stop string ends mid-token and vLLM cuts the text, not the token.
"""

import gc
import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from actors.agent_loop import AgentLoop
from actors.decode_loop import DecodeLoop
from protocols.trajectory import Prompt

pytestmark = pytest.mark.slow

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CALL_TEXT = "<tool_call>calculator:12*34</tool_call>"
MID_TEXT = "<tool_call>calculator:5*6</tool_call>7"
SYMBOLS = [PAD, BOS, EOS, *"0123456789", "+", "*", "=", ":", "calculator", "<tool_call>", "</tool_call>",
           "<tool_response>", "</tool_response>", CALL_TEXT, MID_TEXT]
ID = {s: i for i, s in enumerate(SYMBOLS)}
FIRST_TURN_BIAS = 2.5
"""About a one-in-three chance per token of a call among ~26 near-uniform tokens: some random tokens, then a call."""
MAX_RESPONSE_TOKENS = 48


def build_tool_model(folder: Path, seed: int = 1) -> str:
    """A random untied Qwen2 (head_dim 64 for vLLM's CPU attention) whose tokenizer reads the tags and the two
    whole calls as single tokens and every other character as its own token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel(vocab=dict(ID), unk_token=PAD))
    pieces = sorted((s for s in SYMBOLS if len(s) > 1), key=len, reverse=True)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("|".join(map(re.escape, pieces)) + "|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD,
                            clean_up_tokenization_spaces=False).save_pretrained(str(folder))
    config = Qwen2Config(vocab_size=len(SYMBOLS), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=ID[BOS], eos_token_id=ID[EOS],
                         pad_token_id=ID[PAD], dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = ID[EOS]
    model.save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One rollout worker (its engine, outside Ray) with the calculator tool, for every case here."""
    from actors.rollout_worker import RolloutWorker
    from protocols.config import RunConfig

    path = build_tool_model(tmp_path_factory.mktemp("tool_model"))
    cfg = RunConfig.model_validate({
        "model": {"path": path}, "data": {"max_prompt_tokens": 16},
        "rollout": {"samples_per_prompt": 4, "max_response_tokens": MAX_RESPONSE_TOKENS, "max_num_seqs": 16},
        "tools": {"builtin": ["calculator"], "max_turns": 3, "max_output_tokens": 16},
        "weight_sync": {"verify_every": 0}})
    # vLLM's in-process CPU engine re-binds this process's threads (affinity, torch threads, OMP variables); a Ray
    # cluster or DeepSpeed rank started later by this pytest process would inherit them and compute with other
    # reduction orders, so they are put back when the module ends.
    env, affinity, threads = dict(os.environ), os.sched_getaffinity(0), torch.get_num_threads()
    w = RolloutWorker(cfg, 0, path)
    yield w
    w.agent.close()
    del w
    gc.collect()
    os.environ.clear()
    os.environ.update(env)
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


class RecordingEngine:
    """The engine, recording each request's prompt ids and, once it ends, the ids and text vLLM returned."""

    def __init__(self, engine, first_turn_bias: dict[int, float] | None = None, group_id_parts: int = 1) -> None:
        self.engine = engine
        self.first_turn_bias = first_turn_bias
        """Added to the logits of every first turn: a request id of `group_id_parts` + 1 parts (no turn suffix)."""
        self.group_id_parts = group_id_parts
        self.prompts: dict[str, list[int]] = {}
        self.ended: dict[str, tuple[list[int], str]] = {}

    def add_request(self, request_id, prompt, params):
        self.prompts[request_id] = list(prompt["prompt_token_ids"])
        if self.first_turn_bias is not None and request_id.count("/") == self.group_id_parts:
            params.logit_bias = dict(self.first_turn_bias)
        self.engine.add_request(request_id, prompt, params)

    def step(self):
        outs = self.engine.step()
        for out in outs:
            if out.finished:
                self.ended[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].text)
        return outs

    def has_unfinished_requests(self):
        return self.engine.has_unfinished_requests()

    def abort_request(self, request_ids):
        self.engine.abort_request(request_ids)


class GatedToolBox:
    """The real ToolBox, whose calls wait for `gate` first (so the test decides when tools are done)."""

    def __init__(self, toolbox, gate: threading.Event) -> None:
        self.toolbox, self.gate = toolbox, gate

    def run(self, name, arguments):
        self.gate.wait(60)
        return self.toolbox.run(name, arguments)


def first_turn_bias(sample_index: int) -> dict[int, float]:
    """Even samples call with the whole call token, odd ones with the mid-token one; nothing else ends the turn."""
    call, other = (ID[CALL_TEXT], ID[MID_TEXT]) if sample_index % 2 == 0 else (ID[MID_TEXT], ID[CALL_TEXT])
    return {call: FIRST_TURN_BIAS, other: -100.0, ID[EOS]: -100.0, ID["</tool_call>"]: -100.0}


def hf_logprobs(model, ids: list[int], bias: dict[int, float] | None = None) -> torch.Tensor:
    """log p(ids[j] | ids[:j]) for j >= 1 under `model` at temperature 1, with `bias` added to the logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    if bias:
        for token, b in bias.items():
            logits[:, token] += b
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_response_ids_are_the_engine_samples_plus_tool_tokens_and_a_new_version_stamps_the_later_turns(worker):
    from transformers import Qwen2ForCausalLM

    from actors.vllm_weights import load_checkpoint_weights
    from rewards.tools import ToolBox

    cfg, tok = worker.cfg, worker.tokenizer
    prompt = Prompt(prompt_id="t/0", prompt_token_ids=tok.encode("12+3=", add_special_tokens=False))
    engine = RecordingEngine(worker.engine)

    def params(sample, max_tokens):  # the worker's own (stop at the call tag), biased on each first turn
        p = worker._sampling_params(sample, max_tokens)
        if sample.requests_ended == 0:
            p.logit_bias = first_turn_bias(sample.index)
        return p

    gate = threading.Event()
    agent = AgentLoop(cfg.tools, cfg.reward, tok, toolbox=GatedToolBox(ToolBox(cfg.tools, cfg.reward), gate))
    loop = DecodeLoop(engine, params, 4, MAX_RESPONSE_TOKENS, 0, on_request_end=agent)
    loop.start_group("g", prompt)
    while engine.has_unfinished_requests():
        assert loop.step(0) == []
        # a sample waiting on its tool has no request in the engine
        assert not {f"g/{i}" for _, i in loop.waiting} & set(loop.requests)
        assert worker.engine.get_num_unfinished_requests() == len(loop.requests)
    # every first turn ended at a call: all four wait on their tools, off the engine
    assert sorted(loop.waiting) == [("g", i) for i in range(4)] and loop.has_unfinished()

    # new weights between the turns: version 1
    old = Qwen2ForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    new = Qwen2ForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32).eval()
    torch.manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    load_checkpoint_weights(worker.llm, list(new.state_dict().items()))
    gate.set()
    groups, deadline = [], time.monotonic() + 120
    while loop.has_unfinished():
        assert time.monotonic() < deadline
        groups += loop.step(1)
    (group,) = groups
    agent.close()

    template = cfg.tools.output_template
    for t in group.trajectories:
        turns = [f"g/{t.sample_index}"] + [f"g/{t.sample_index}/{k}" for k in range(1, t.num_turns)]
        # model segments are exactly the ids the engine returned per request; tool segments the rendered output
        # tokenized once
        expected, segments = [], iter(t.segments)
        for k, request_id in enumerate(turns):
            sampled, _ = engine.ended[request_id]
            assert engine.prompts[request_id] == prompt.prompt_token_ids + expected  # the exact prefix
            expected += sampled
            if sampled:
                assert next(segments).token_ids == sampled
            if k < len(t.tool_calls or []):
                call = t.tool_calls[k]
                tool_ids = tok.encode(template.replace("{output}", call.output), add_special_tokens=False)
                assert next(segments).token_ids == tool_ids and call.output_start == len(expected)
                expected += tool_ids
        assert t.response_token_ids == expected
        # the first call is the biased one: the calculator's answer, no error
        first_sampled, first_text = engine.ended[turns[0]]
        assert t.tool_calls[0].output == ("408" if t.sample_index % 2 == 0 else "30") and not t.tool_calls[0].error
        if t.sample_index % 2:
            # the stop string ended inside the last token: vLLM cut the text after the tag, and that token id is
            # what the continuation was given (nothing re-tokenized)
            assert first_sampled[-1] == ID[MID_TEXT] and first_text.endswith("</tool_call>")
        # log-probs and versions on model tokens only: turn 1 at version 0, later turns at 1, tool tokens -1 / 0.0
        mask = t.loss_mask
        first_len = len(first_sampled)
        assert t.token_versions == [(0 if j < first_len else 1) if m else -1 for j, m in enumerate(mask)]
        assert all(lp == 0.0 for lp, m in zip(t.behavior_logprobs, mask) if not m)
        # and each model token's behavior log-prob is its log-prob under the weights that sampled it, in the
        # context of every earlier token, tool tokens included (the first turn with its bias)
        ids = prompt.prompt_token_ids + t.response_token_ids
        start = len(prompt.prompt_token_ids) - 1
        under_old = hf_logprobs(old, ids, first_turn_bias(t.sample_index))[start:start + first_len]
        under_new = hf_logprobs(new, ids)[start:]
        got = torch.tensor(t.behavior_logprobs, dtype=torch.float64)
        torch.testing.assert_close(got[:first_len], under_old, atol=2e-4, rtol=0)
        later = torch.tensor(mask[first_len:])
        torch.testing.assert_close(got[first_len:][later], under_new[first_len:][later], atol=2e-4, rtol=0)
    load_checkpoint_weights(worker.llm, list(old.state_dict().items()))


def test_evaluation_runs_the_agent_loop_and_scores_the_final_answer(worker):
    from actors import eval_generation

    cfg, tok = worker.cfg, worker.tokenizer
    prompts = [Prompt(prompt_id=f"e/{i}", prompt_token_ids=tok.encode(f"{i}+1=", add_special_tokens=False))
               for i in range(3)]
    # greedy, the first turn forced to call (bias +100 on the whole call): the call, the tool's answer, then the
    # model's greedy continuation
    engine = RecordingEngine(worker.engine, {ID[CALL_TEXT]: 100.0}, group_id_parts=2)  # ids `eval/P/S[/turn]`
    agent = AgentLoop(cfg.tools, cfg.reward, tok, toolbox=worker.agent.toolbox)
    responses = eval_generation.agent_responses(engine, agent, prompts, 2, 0.0, 1.0, 0, MAX_RESPONSE_TOKENS)
    agent.close()
    assert [len(r) for r in responses] == [2, 2, 2]
    for samples in responses:
        a, b = samples
        assert a.response_token_ids == b.response_token_ids  # greedy
        assert a.response_token_ids[0] == ID[CALL_TEXT] and a.tool_calls[0].output == "408"
        row = eval_generation.response_row(a)
        assert row["text"] == a.final_text and row["response"].endswith(row["text"])
        assert row["response"].startswith(CALL_TEXT + "<tool_response>408</tool_response>")
        assert row["tool_calls"] == len(a.tool_calls) and row["tokens"] <= MAX_RESPONSE_TOKENS
    # the worker's own entry points run through the same loop
    texts = worker.generate_greedy(prompts)
    rows = worker.generate_eval(prompts, 2, 1.0, 1.0, 0)
    assert len(texts) == 3 and all(isinstance(x, str) for x in texts)
    assert [len(r) for r in rows] == [2, 2, 2] and all(r["response"].endswith(r["text"]) for rs in rows for r in rs)


class CalculatorEnv:
    """An OpenEnv-shaped environment (tools.environment): its `calculator` method is the tool; the reward is 1 when
    the episode's first result is the row's answer."""

    def reset(self, answer: str = "", **row) -> None:
        self.answer, self.results = answer, []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. 12*34.
        """
        from rewards.tools import calculate

        self.results.append(calculate(expression))
        return self.results[-1]

    @property
    def reward(self) -> float:
        return float(bool(self.results) and self.results[0] == self.answer)


def test_an_environment_episode_runs_on_the_engine_and_its_reward_lands_on_the_trajectory(worker):
    cfg, tok = worker.cfg, worker.tokenizer
    tools = cfg.tools.model_copy(update={"builtin": [], "environment": "tests.test_agent_loop_engine:CalculatorEnv"})
    prompt = Prompt(prompt_id="t/0", prompt_token_ids=tok.encode("12*34=", add_special_tokens=False), answer="408")
    engine = RecordingEngine(worker.engine)

    def params(sample, max_tokens):
        p = worker._sampling_params(sample, max_tokens)
        if sample.requests_ended == 0:
            p.logit_bias = first_turn_bias(sample.index)
        return p

    agent = AgentLoop(tools, cfg.reward, tok)
    loop = DecodeLoop(engine, params, 4, MAX_RESPONSE_TOKENS, 0, on_request_end=agent)
    loop.start_group("g", prompt)
    groups, deadline = [], time.monotonic() + 120
    while loop.has_unfinished():
        assert time.monotonic() < deadline
        groups += loop.step(0)
    agent.close()
    (group,) = groups
    for t in group.trajectories:
        # even samples call 12*34 (the answer, reward 1), odd ones 5*6 (reward 0), through the instance's method
        first = t.tool_calls[0]
        assert (first.name, first.arguments, first.error) == (
            "calculator", "12*34" if t.sample_index % 2 == 0 else "5*6", "")
        assert first.output == ("408" if t.sample_index % 2 == 0 else "30")
        assert t.environment_reward == (1.0 if t.sample_index % 2 == 0 else 0.0)
        assert not any(t.loss_mask[first.output_start:first.output_start + first.output_tokens])
    assert agent.counts["environment_episodes"] == 4 and agent.counts["environment_bad_rewards"] == 0
    assert agent.episodes == {}
