"""The session endpoint's token contract (gateway/episode.py, episode_samples.py) with a real Hugging Face tokenizer
and Qwen2.5's chat template: a call that extends the previous messages and reply gets the previous ids plus the
template's delta of the new messages; an episode whose calls extend each other is one sample of exactly the ids the
engine saw and sampled; splits are counted by reason; a retry never trains twice.

The engine is played by lists: what it "sampled" for each call is written out below. The tokenizer merges `ab`
into one token, so a reply sampled as `a`, `b` re-tokenizes differently: the test of what is never re-tokenized."""

import pickle

import pytest

from gateway.chat_render import ChatRenderer
from gateway.episode import ChatCall, Episode
from gateway.episode_samples import episode_samples
from protocols.trajectory import Trajectory
from tests.tiny_chat_tokenizer import THINK_DROPPING_TEMPLATE, build_chat_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object",
                                                          "properties": {"e": {"type": "string"}}}}}]
CALL_TEXT = '<tool_call>\n{"name": "calc", "arguments": {"e": "12*3"}}\n</tool_call>'
"""A call as the template itself writes one: the text of the engine's reply and of the template's re-render agree."""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("qwen25"))


@pytest.fixture(scope="module")
def think_tok(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("think"), THINK_DROPPING_TEMPLATE)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def byte_ids(tok, text):
    """`text` one token per character, as a model may sample it (never merged into `ab` or `12`)."""
    return [tok.convert_tokens_to_ids(tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(ch)[0][0])
            for ch in text]


def tool_reply(call_id="call_1", content=None):
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "calc", "arguments": '{"e": "12*3"}'}}]}


def serve(episode, call, sampled, version, finish="stop", reply=None):
    """Plan the call's prompt and record what the engine sampled on it: log-prob -0.5 and `version` per token."""
    plan = episode.plan(call)
    record = episode.record(call, plan, reply or {"role": "assistant", "content": ""}, sampled,
                            [-0.5] * len(sampled), [version] * len(sampled), finish)
    return plan, record


def three_call_episode(tok, history="extend"):
    renderer = ChatRenderer(tok)
    episode = Episode(renderer, history)
    end = ids(tok, "<|im_end|>")
    first = [{"role": "user", "content": "what is ab 12*3?"}]
    # call 1: the model calls the tool; `ab` sampled as two tokens, as no re-tokenization would give
    s1 = byte_ids(tok, "ab ") + ids(tok, CALL_TEXT) + end
    p1, _ = serve(episode, ChatCall(first, TOOLS), s1, 3, reply=tool_reply(content="ab "))
    # call 2: the client adds the tool's result and the echo of the reply (its own tool-call id)
    second = [*first, tool_reply("rewritten_id", "ab "),
              {"role": "tool", "tool_call_id": "rewritten_id", "content": "36"}]
    s2 = ids(tok, CALL_TEXT) + end
    p2, _ = serve(episode, ChatCall(second, TOOLS), s2, 4, reply=tool_reply())
    third = [*second, tool_reply(), {"role": "tool", "tool_call_id": "x", "content": "36"}]
    s3 = ids(tok, "36") + end
    p3, _ = serve(episode, ChatCall(third, TOOLS), s3, 4, reply={"role": "assistant", "content": "36"})
    return episode, (p1, p2, p3), (s1, s2, s3)


def test_a_call_that_extends_gets_the_previous_ids_and_the_template_delta(tok):
    episode, (p1, p2, p3), (s1, s2, s3) = three_call_episode(tok)
    tool_turn = "\n<|im_start|>user\n<tool_response>\n36\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # the `\n` after the sampled <|im_end|> is the template's (Qwen closes a turn with `<|im_end|>\n`)
    assert p2.prompt_ids == p1.prompt_ids + s1 + ids(tok, tool_turn) and p2.parent == 0
    assert p3.prompt_ids == p2.prompt_ids + s2 + ids(tok, tool_turn) and p3.parent == 1
    # the same text as the template's whole rendering, but not its ids: the sampled `a`, `b` stayed two tokens
    whole = tok.apply_chat_template(
        [{"role": "user", "content": "what is ab 12*3?"},
         {"role": "assistant", "content": "ab ",
          "tool_calls": [{"function": {"name": "calc", "arguments": {"e": "12*3"}}}]},
         {"role": "tool", "content": "36"}], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert tok.decode(p2.prompt_ids, skip_special_tokens=False) == whole.replace("ab \n<tool_call>", "ab <tool_call>")
    assert p2.prompt_ids != ids(tok, tok.decode(p2.prompt_ids, skip_special_tokens=False))
    assert sum(episode.counts[k] for k in episode.counts if k.startswith("splits_")) == 0


def test_an_episode_whose_calls_extend_each_other_is_one_sample_of_the_engine_log(tok):
    episode, (p1, p2, p3), (s1, s2, s3) = three_call_episode(tok)
    samples, counts = episode_samples(episode.calls, "ep", "g", reward=1.0)
    assert counts["samples"] == 1 and len(samples) == 1
    t = samples[0]
    # prompt + response is the last call's prompt + its sampled ids: exactly what the engine saw and sampled
    assert t.prompt.prompt_token_ids == p1.prompt_ids
    assert p1.prompt_ids + t.response_token_ids == p3.prompt_ids + s3
    d1 = len(p2.prompt_ids) - len(p1.prompt_ids) - len(s1)
    d2 = len(p3.prompt_ids) - len(p2.prompt_ids) - len(s2)
    assert t.loss_mask == [True] * len(s1) + [False] * d1 + [True] * len(s2) + [False] * d2 + [True] * len(s3)
    assert t.token_versions == [3] * len(s1) + [-1] * d1 + [4] * len(s2) + [-1] * d2 + [4] * len(s3)
    assert t.behavior_logprobs == [-0.5] * len(s1) + [0.0] * d1 + [-0.5] * len(s2) + [0.0] * d2 + [-0.5] * len(s3)
    assert (t.min_version, t.max_version, t.reward) == (3, 4, 1.0)
    assert [s.kind for s in t.segments] == ["model", "context", "model", "context", "model"]


def test_calls_older_than_the_staleness_bound_are_cut_at_a_call_boundary(tok):
    # versions of the calls' tokens: 3, 4, 4. Oldest version still trained 4 (e.g. the worker at version 6 with
    # train.max_staleness 2): call 1 is cut; the sample starts at call 2, whose prompt holds call 1 exactly as the
    # engine saw and sampled it
    episode, (p1, p2, p3), (s1, s2, s3) = three_call_episode(tok)
    (t,), counts = episode_samples(episode.calls, "ep", "g", reward=1.0, min_version=4)
    assert counts["staleness_cuts"] == 1 and t.prompt.metadata["calls"] == [1, 2]
    assert t.prompt.prompt_token_ids == p2.prompt_ids and p2.prompt_ids + t.response_token_ids == p3.prompt_ids + s3
    d2 = len(p3.prompt_ids) - len(p2.prompt_ids) - len(s2)
    assert t.loss_mask == [True] * len(s2) + [False] * d2 + [True] * len(s3)
    assert t.min_version == 4  # staleness now counts from call 2's tokens
    # within the bound nothing is cut; past it even for the last call, the last call stays (the queue drops it)
    assert episode_samples(episode.calls, "ep", "g", 1.0, min_version=3)[1]["staleness_cuts"] == 0
    (last,), counts = episode_samples(episode.calls, "ep", "g", 1.0, min_version=9)
    assert counts["staleness_cuts"] == 2 and last.prompt.prompt_token_ids == p3.prompt_ids and last.response_token_ids == s3


def test_render_mode_splits_where_the_template_re_tokenizes_the_reply(tok):
    # the template renders call 1's reply as `\nab \n<tool_call>` with `ab` one token: not what the engine sampled
    episode, (p1, p2, p3), _ = three_call_episode(tok, history="render")
    assert (p2.parent, p2.split_reason) == (None, "rendered_history")
    assert p3.parent == 1  # call 2's reply was sampled as the template writes it (no content): call 3 joins it
    samples, _ = episode_samples(episode.calls, "ep", "g", reward=1.0)
    assert len(samples) == 2 and episode.counts["splits_rendered_history"] == 1
    assert samples[1].prompt.prompt_token_ids == p2.prompt_ids
    assert samples[1].prompt.metadata["split_reason"] == "rendered_history"


def test_dropped_thinking_is_one_sample_under_extend_and_two_under_render(think_tok):
    tok = think_tok
    end = ids(tok, "<|im_end|>")
    first = [{"role": "user", "content": "q1"}]
    reply = {"role": "assistant", "content": "<think>abc</think>a1"}
    second = [*first, reply, {"role": "user", "content": "q2"}]
    results = {}
    for history in ("extend", "render"):
        episode = Episode(ChatRenderer(tok), history)
        p1, _ = serve(episode, ChatCall(first), ids(tok, "<think>abc</think>a1") + end, 0, reply=reply)
        p2, _ = serve(episode, ChatCall(second), ids(tok, "a2") + end, 0, reply={"role": "assistant", "content": "a2"})
        results[history] = (p1, p2, episode_samples(episode.calls, "ep", "g", 0.0)[0])
    p1, p2, samples = results["extend"]
    # extend keeps the thinking as sampled: the engine's second prompt still holds it
    assert p2.prompt_ids == p1.prompt_ids + ids(tok, "<think>abc</think>a1") + end + ids(
        tok, "\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n")
    assert len(samples) == 1
    p1, p2, samples = results["render"]
    # render follows the template, which dropped it: a new segment, each sample what the engine saw
    assert tok.decode(p2.prompt_ids, skip_special_tokens=False).count("<think>") == 0
    assert len(samples) == 2 and p2.split_reason == "rendered_history"
    assert samples[1].prompt.prompt_token_ids + samples[1].response_token_ids == p2.prompt_ids + ids(tok, "a2") + end


def test_no_join_across_a_change_of_tools_template_args_or_history(tok):
    end = ids(tok, "<|im_end|>")
    first = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "yo"}
    cases = {
        "tools_changed": ChatCall([*first, reply, {"role": "user", "content": "again"}], TOOLS),
        "template_args_changed": ChatCall([*first, reply, {"role": "user", "content": "again"}], None,
                                          {"enable_thinking": False}),
        "edited_history": ChatCall([{"role": "user", "content": "HI"}, reply, {"role": "user", "content": "again"}]),
    }
    for reason, call in cases.items():
        episode = Episode(ChatRenderer(tok))
        serve(episode, ChatCall(first), ids(tok, "yo") + end, 0, reply=reply)
        plan, _ = serve(episode, call, ids(tok, "ok") + end, 0)
        assert (plan.parent, plan.split_reason) == (None, reason)
        assert plan.prompt_ids == ids(tok, tok.apply_chat_template(
            list(call.messages), tools=call.tools, tokenize=False, add_generation_prompt=True, **call.template_args))
        assert episode.counts[f"splits_{reason}"] == 1
        assert len(episode_samples(episode.calls, "ep", "g", 0.0)[0]) == 2


def test_a_retried_call_gets_the_same_prompt_and_trains_once(tok):
    episode = Episode(ChatRenderer(tok))
    end = ids(tok, "<|im_end|>")
    first = [{"role": "user", "content": "q"}]
    p0, r0 = serve(episode, ChatCall(first), ids(tok, "a") + end, 0, reply={"role": "assistant", "content": "a"})
    second = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}]
    # the client's SDK timed out and sent call 2 again; the engine sampled another reply, which the client used
    p1, _ = serve(episode, ChatCall(second), ids(tok, "b1") + end, 0, reply={"role": "assistant", "content": "b1"})
    p2, _ = serve(episode, ChatCall(second), ids(tok, "b2") + end, 1, reply={"role": "assistant", "content": "b2"})
    assert p2.prompt_ids == p1.prompt_ids and (p2.parent, p2.retry_of) == (0, 1)
    third = [*second, {"role": "assistant", "content": "b2"}, {"role": "user", "content": "end"}]
    p3, _ = serve(episode, ChatCall(third), ids(tok, "c") + end, 1, reply={"role": "assistant", "content": "c"})
    assert p3.parent == 2
    samples, counts = episode_samples(episode.calls, "ep", "g", 1.0)
    # one sample: calls 0, 2, 3; the orphan (call 1) is dropped: 2 + 3 + 2 sampled tokens train, not 10
    assert (len(samples), counts["retry_orphans"], episode.counts["retries"]) == (1, 1, 1)
    assert sum(samples[0].loss_mask) == 2 + 3 + 2
    assert samples[0].prompt.metadata["calls"] == [0, 2, 3]


def test_a_reply_cut_at_max_tokens_is_closed_by_an_inserted_turn_end(tok):
    episode = Episode(ChatRenderer(tok))
    first = [{"role": "user", "content": "q"}]
    p0, _ = serve(episode, ChatCall(first), ids(tok, "long"), 0, "length", {"role": "assistant", "content": "long"})
    second = [*first, {"role": "assistant", "content": "long"}, {"role": "user", "content": "go on"}]
    p1, _ = serve(episode, ChatCall(second), ids(tok, "x") + ids(tok, "<|im_end|>"), 0)
    assert p1.prompt_ids == p0.prompt_ids + ids(tok, "long") + ids(
        tok, "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")
    (t,), _ = episode_samples(episode.calls, "ep", "g", 0.0)
    assert t.loss_mask.count(False) == len(p1.prompt_ids) - len(p0.prompt_ids) - 4  # all but the 4 sampled


def test_a_branch_trains_shared_calls_once(tok):
    # a sub-agent: two different follow-ups of call 0 (both extend it); the second leaf holds call 0 as prompt
    episode = Episode(ChatRenderer(tok))
    end = ids(tok, "<|im_end|>")
    first = [{"role": "user", "content": "q"}]
    p0, _ = serve(episode, ChatCall(first), ids(tok, "a") + end, 0, reply={"role": "assistant", "content": "a"})
    for follow_up in ("x", "y"):
        serve(episode, ChatCall([*first, {"role": "assistant", "content": "a"},
                                 {"role": "user", "content": follow_up}]), ids(tok, "z") + end, 0)
    samples, counts = episode_samples(episode.calls, "ep", "g", 0.5)
    assert [s.prompt.metadata["calls"] for s in samples] == [[0, 1], [2]]
    assert samples[1].prompt.prompt_token_ids == episode.calls[2].plan.prompt_ids
    assert [sum(s.loss_mask) for s in samples] == [2 + 2, 2]


def test_an_episode_sample_round_trips_and_plain_records_are_unchanged(tok):
    episode, _, _ = three_call_episode(tok)
    (t,), _ = episode_samples(episode.calls, "ep", "g", 1.0, tokenizer=tok)
    assert Trajectory.model_validate_json(t.model_dump_json()) == t
    assert pickle.loads(pickle.dumps(t)) == t
    plain = Trajectory.model_validate(t.model_dump(exclude={"context_spans"}))
    assert "context_spans" not in plain.model_dump() and "context_spans" not in pickle.dumps(plain).decode("latin1")
    assert t.response_text.startswith("ab ")


def test_completions_calls_join_where_their_ids_start_with_an_earlier_calls(tok):
    episode = Episode(ChatRenderer(tok))
    p0, _ = serve(episode, ChatCall([], prompt_ids=(5, 6, 7)), [8, 9], 0)
    p1, _ = serve(episode, ChatCall([], prompt_ids=(5, 6, 7, 8, 9, 10)), [11], 0)
    p2, _ = serve(episode, ChatCall([], prompt_ids=(5, 6, 4)), [12], 0)
    assert (p0.parent, p1.parent, p2.parent, p2.split_reason) == (None, 0, None, "edited_history")
    samples, _ = episode_samples(episode.calls, "ep", "g", 0.0)
    # [5 6 7] + sampled [8 9] + inserted [10] + sampled [11]; then [5 6 4] + [12]
    assert [(s.prompt.prompt_token_ids, s.response_token_ids, s.loss_mask) for s in samples] == [
        ([5, 6, 7], [8, 9, 10, 11], [True, True, False, True]), ([5, 6, 4], [12], [True])]


def test_a_template_that_does_not_close_turns_with_the_turn_end_starts_a_new_segment(tok):
    # the template never writes <|endoftext|>: the delta after a turn's end cannot be found, so no join
    episode = Episode(ChatRenderer(tok, turn_end="<|endoftext|>"))
    first = [{"role": "user", "content": "q"}]
    serve(episode, ChatCall(first), ids(tok, "a<|im_end|>"), 0, reply={"role": "assistant", "content": "a"})
    plan, _ = serve(episode, ChatCall([*first, {"role": "assistant", "content": "a"},
                                       {"role": "user", "content": "b"}]), ids(tok, "c<|im_end|>"), 0)
    assert (plan.parent, plan.split_reason) == (None, "template_not_prefix")
    assert episode.counts["splits_template_not_prefix"] == 1
