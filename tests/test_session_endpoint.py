"""The session endpoint (gateway/) served by a real rollout worker's vLLM engine, driven by the stock `openai` SDK:
a 3-call episode (a tool result and a user turn between the calls, one call streamed) becomes one training sample
whose ids are what the engine saw and sampled, whose behavior log-probs match a transformers forward, and whose
inserted tokens carry no loss; and hostile or broken clients get clear statuses while the server goes on.

The worker is built outside Ray, as in test_agent_loop_engine; `EngineThread` steps its decode loop and pumps
the endpoint's calls into it, as `RolloutWorker.run` does between its other work."""

import gc
import os
import threading

import httpx
import openai
import pytest
import torch

from gateway.engine_bridge import EngineThread
from tests.tiny_chat_tokenizer import build_chat_tokenizer

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object",
                                                          "properties": {"e": {"type": "string"}}}}}]
MAX_CALLS = 3
MAX_SESSIONS = 1000
VERSION = [0]
"""The policy version the engine thread stamps tokens with (a test moves it, as a weight load would)."""


def build_chat_model(folder) -> str:
    """A random untied Qwen2 (head_dim 64 for vLLM's CPU attention) over the Qwen2.5-template tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_chat_tokenizer(folder)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None, dtype="float32")
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(str(folder))
    return str(folder)


class RecordingEngine:
    """The engine, recording each request's prompt ids and the ids it returned once the request ended."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.log: list[tuple[list[int], list[int]]] = []
        self._prompts: dict[str, list[int]] = {}

    def add_request(self, request_id, prompt, params):
        self._prompts[request_id] = list(prompt["prompt_token_ids"])
        self.engine.add_request(request_id, prompt, params)

    def step(self):
        outs = self.engine.step()
        for out in outs:
            if out.finished:
                self.log.append((self._prompts.pop(out.request_id), list(out.outputs[0].token_ids)))
        return outs

    def has_unfinished_requests(self):
        return self.engine.has_unfinished_requests()

    def abort_request(self, request_ids):
        self.engine.abort_request(request_ids)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from actors.rollout_worker import RolloutWorker
    from protocols.config import RunConfig

    path = build_chat_model(tmp_path_factory.mktemp("chat_model"))
    cfg = RunConfig.model_validate({
        "output_dir": str(tmp_path_factory.mktemp("run")), "model": {"path": path},
        "data": {"max_prompt_tokens": 1536}, "rollout": {"max_response_tokens": 32, "max_num_seqs": 8, "samples_per_prompt": 2},
        "gateway": {"enabled": True, "max_calls_in_flight": MAX_CALLS, "max_sessions": MAX_SESSIONS},
        "weight_sync": {"verify_every": 0}})
    env, affinity, threads = dict(os.environ), os.sched_getaffinity(0), torch.get_num_threads()
    worker = RolloutWorker(cfg, 0, path)
    recording = RecordingEngine(worker.decoding.engine)
    worker.decoding.engine = recording
    VERSION[0] = worker.version
    loop = EngineThread(worker.decoding, worker.gateway.inbox, lambda: VERSION[0]).start()
    yield worker, loop, recording, path
    loop.stop()
    worker.gateway.stop()
    del worker
    gc.collect()
    os.environ.clear()
    os.environ.update(env)
    os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)


def new_session(url: str, **body) -> dict:
    r = httpx.post(f"{url}/sessions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def echo(message) -> dict:
    """The assistant message as an agent sends it back: the SDK's model, dumped."""
    return message.model_dump(exclude_none=True)


def test_an_openai_sdk_episode_is_one_sample_of_exactly_the_engine_log(endpoint):
    from transformers import Qwen2ForCausalLM

    worker, loop, recording, path = endpoint
    url = worker.gateway.url
    # two sessions of one task: the learner's group (rollout.samples_per_prompt=2)
    s, other = new_session(url, group="t1"), new_session(url, group="t1")
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    assert [m.id for m in client.models.list()] == ["relayrl"]
    logged = len(recording.log)
    messages = [{"role": "user", "content": "what is 12*3?"}]
    first = client.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=8,
                                           temperature=1.0)  # the run's own temperature may be restated
    messages += [echo(first.choices[0].message), {"role": "tool", "tool_call_id": "c1", "content": "36"}]
    # the second call streamed: the SDK's chunks put back together
    content, calls = "", []
    for chunk in client.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=8,
                                                stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        calls += [c.model_dump(exclude_none=True) for c in (delta.tool_calls or [])] if delta else []
    messages += [{"role": "assistant", "content": content,
                  **({"tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]} if calls else {})},
                 {"role": "user", "content": "sure?"}]
    third = client.chat.completions.create(model="any", messages=messages, tools=TOOLS, max_tokens=8)
    assert third.usage.prompt_tokens > first.usage.prompt_tokens
    r = httpx.post(f"{url}/sessions/{s['session_id']}/reward", json={"reward": {"reward": 1.0, "correct": True}},
                   headers={"Authorization": f"Bearer {s['api_key']}"})
    assert r.status_code == 200 and r.json()["calls"] == 3
    log = recording.log[logged:]
    assert len(log) == 3
    openai.OpenAI(base_url=other["base_url"], api_key=other["api_key"], max_retries=0).chat.completions.create(
        model="any", messages=[{"role": "user", "content": "what is 12*3?"}], max_tokens=4)
    httpx.post(f"{url}/sessions/{other['session_id']}/reward", json={"reward": 0},
               headers={"Authorization": f"Bearer {other['api_key']}"})
    (group,) = worker.gateway.take_groups()
    t, t_other = group.trajectories
    assert (t_other.reward, t_other.sample_index) == (0.0, 1)
    # one sample: the last call's prompt and sampled ids, which start with each earlier call's prompt + sampled
    (p1, s1), (p2, s2), (p3, s3) = log
    assert p2[: len(p1) + len(s1)] == p1 + s1 and p3[: len(p2) + len(s2)] == p2 + s2
    assert t.prompt.prompt_token_ids == p1 and p1 + t.response_token_ids == p3 + s3
    mask = t.loss_mask
    assert sum(mask) == len(s1) + len(s2) + len(s3)
    assert mask == [True] * len(s1) + [False] * (len(p2) - len(p1) - len(s1)) + [True] * len(s2) + [False] * (
        len(p3) - len(p2) - len(s2)) + [True] * len(s3)
    assert all(v == 0 for v, m in zip(t.token_versions, mask) if m)
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(t.token_versions, t.behavior_logprobs, mask) if not m)
    assert (t.reward, t.result.correct) == (1.0, True)
    # every sampled token's log-prob is the model's (temperature 1, fp32): a transformers forward of the sample
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = p1 + t.response_token_ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    hf = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)[len(p1) - 1:]
    engine = torch.tensor(t.behavior_logprobs, dtype=torch.float64)
    m = torch.tensor(mask)
    torch.testing.assert_close(engine[m], hf[m], atol=2e-4, rtol=0)
    counts = worker.gateway.book.counts
    assert counts["sessions_rewarded"] >= 1


def test_completions_and_key_selected_routes_serve_the_session(endpoint):
    worker, *_ = endpoint
    s = new_session(worker.gateway.url)
    # the same session through /v1 (the key alone selects it) and through its own base_url
    by_key = openai.OpenAI(base_url=f"{worker.gateway.url}/v1", api_key=s["api_key"], max_retries=0)
    first = by_key.completions.create(model="any", prompt="12*3=", max_tokens=4)
    assert first.usage.completion_tokens >= 1 and first.choices[0].finish_reason in ("stop", "length")
    session = worker.gateway.book.sessions[s["session_id"]]
    (call,) = session.episode.calls
    # a second completion on the first's prompt + its text: joins it at the token level when the ids agree
    by_url = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    by_url.completions.create(model="any", prompt=call.ids, max_tokens=4, extra_body={})
    assert session.episode.calls[1].plan.parent == 0
    httpx.post(f"{worker.gateway.url}/sessions/{s['session_id']}/finish",
               headers={"Authorization": f"Bearer {s['api_key']}"})
    assert worker.gateway.take_groups() == []  # finished without a reward: not trained


def test_broken_and_hostile_clients_get_clear_statuses(endpoint):
    worker, loop, *_ = endpoint
    url = worker.gateway.url
    s = new_session(url)
    auth = {"Authorization": f"Bearer {s['api_key']}"}
    chat = f"{url}/sessions/{s['session_id']}/v1/chat/completions"
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(chat, content=b"{not json", headers=auth).status_code == 400
    assert httpx.post(chat, json={"messages": "hi"}, headers=auth).status_code == 400
    # JSON nested past the decoder's recursion, and stream_options that is not an object: refused before any call
    assert httpx.post(chat, content=b"[" * 100_000, headers=auth).status_code == 400
    r = httpx.post(chat, json={**hi, "stream": True, "stream_options": [1]}, headers=auth)
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    # numbers past a float's range: 400, not a server error
    assert httpx.post(f"{url}/sessions", content=b'{"timeout_s": 1' + b"0" * 400 + b"}").status_code == 400
    assert httpx.post(chat, json=hi, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(f"{url}/sessions/nope/v1/chat/completions", json=hi, headers=auth).status_code == 404
    assert httpx.post(chat, json={**hi, "max_tokens": 10**9}, headers=auth).status_code == 200  # clamped to 32
    assert worker.gateway.book.counts["clamped_max_tokens"] >= 1
    reward = f"{url}/sessions/{s['session_id']}/reward"
    assert httpx.post(reward, json={"reward": "high"}, headers=auth).status_code == 400
    assert httpx.post(reward, json={"reward": 0.5}, headers=auth).status_code == 200
    r = httpx.post(reward, json={"reward": 0.5}, headers=auth)
    assert r.status_code == 409 and "already has its reward" in r.json()["error"]["message"]
    assert httpx.post(chat, json=hi, headers=auth).status_code == 410  # finished
    worker.gateway.take_groups()
    # a reward after the session finished without one is refused
    late = new_session(url)
    late_auth = {"Authorization": f"Bearer {late['api_key']}"}
    httpx.post(f"{url}/sessions/{late['session_id']}/finish", headers=late_auth)
    r = httpx.post(f"{url}/sessions/{late['session_id']}/reward", json={"reward": 1}, headers=late_auth)
    assert r.status_code == 410


def test_n_logprobs_seed_and_stop_are_served_as_the_engine_sampled_them(endpoint):
    """n choices are n leaves of the session's call tree; logprobs are the behavior log-probs trained on, with the
    engine's top alternatives; a seed gives the same sample again; a stop string ends the reply where it starts."""
    worker, *_ = endpoint
    url, book = worker.gateway.url, worker.gateway.book
    s = new_session(url)
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    ask = {"model": "any", "messages": [{"role": "user", "content": "three"}], "max_completion_tokens": 6}
    reply = client.chat.completions.create(**ask, n=3, logprobs=True, top_logprobs=2, seed=11)
    calls = book.sessions[s["session_id"]].episode.calls
    assert len(reply.choices) == 3 and [c.index for c in reply.choices] == [0, 1, 2] and len(calls) == 3
    assert reply.usage.completion_tokens == sum(len(c.sampled_ids) for c in calls)
    for choice, call in zip(reply.choices, calls):
        assert choice.message.content == call.reply["content"]
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(call.behavior_logprobs, abs=1e-6)
        for token in choice.logprobs.content:
            tops = [t.logprob for t in token.top_logprobs]
            assert len(tops) == 2 and tops[0] >= tops[1] and tops[0] >= token.logprob - 1e-6
    again = client.chat.completions.create(**ask, seed=11)  # choice 0 of the first request drew from seed 11
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert book.sessions[s["session_id"]].episode.calls[3].sampled_ids == calls[0].sampled_ids
    # a stop string from that text: the same seeded sample, ended where the stop string starts, and left out
    text = reply.choices[0].message.content
    for cut in range(1, len(text)):
        stop = text[cut:cut + 2]
        if len(stop) == 2 and stop.strip() and text.index(stop) == cut:
            break
    else:
        pytest.skip(f"the random model's text {text!r} has no stop string to cut at")
    stopped = client.chat.completions.create(**ask, seed=11, stop=[stop])
    assert stopped.choices[0].message.content == text[:cut] and stopped.choices[0].finish_reason == "stop"


def test_fields_that_would_change_the_sampled_distribution_are_refused_by_name(endpoint):
    worker, *_ = endpoint
    s = new_session(worker.gateway.url)
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    ask = {"model": "any", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for extra, param in (({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"temperature": 0.3}, "temperature"), ({"presence_penalty": 0.5}, "presence_penalty"),
                         ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**ask, **extra)
        assert refused.value.param == param and param in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:  # an image would be dropped from the prompt: refused
        client.chat.completions.create(model="any", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    assert refused.value.param == "messages[0].content" and "image_url" in refused.value.message
    assert book_calls(worker, s) == 0  # nothing reached the engine
    other = new_session(worker.gateway.url)  # OpenAI's `developer` role: the template's system turn
    openai.OpenAI(base_url=other["base_url"], api_key=other["api_key"], max_retries=0).chat.completions.create(
        model="any", max_tokens=2, messages=[{"role": "developer", "content": "Be brief."},
                                             {"role": "user", "content": "hi"}])
    (call,) = worker.gateway.book.sessions[other["session_id"]].episode.calls
    assert worker.gateway.book.renderer.tokenizer.decode(call.plan.prompt_ids).startswith(
        "<|im_start|>system\nBe brief.")
    assert client.models.retrieve("relayrl").id == "relayrl"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    # the legacy completions route streams too: the chunks put together are the recorded reply
    chunks = list(client.completions.create(model="any", prompt="12*3=", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    (call,) = worker.gateway.book.sessions[s["session_id"]].episode.calls
    assert "".join(c.choices[0].text for c in chunks if c.choices) == call.reply["content"]
    assert chunks[-1].usage.completion_tokens == len(call.sampled_ids)


def book_calls(worker, s) -> int:
    return len(worker.gateway.book.sessions[s["session_id"]].episode.calls)


def test_over_capacity_a_call_is_answered_429_with_retry_after_and_the_waiting_ones_are_served(endpoint):
    worker, loop, *_ = endpoint
    clients = []
    for _ in range(MAX_CALLS + 1):  # a session's calls are one sequence: parallel calls come from many sessions
        s = new_session(worker.gateway.url)
        clients.append(openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0))
    client = clients[-1]
    loop.pause()  # the engine stops taking calls: MAX_CALLS of them wait in the inbox
    results: list = []

    def call(i):
        results.append(clients[i].chat.completions.create(
            model="any", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(MAX_CALLS)]
    for th in threads:
        th.start()
    while worker.gateway.inbox.in_flight < MAX_CALLS:
        threading.Event().wait(0.01)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "one more"}], max_tokens=2)
    assert refused.value.response.headers["Retry-After"] == "1"
    loop.resume()
    for th in threads:
        th.join(60)
    assert len(results) == MAX_CALLS and worker.gateway.book.counts["calls_refused"] >= 1


def test_a_thousand_sessions_open_then_the_next_waits(endpoint):
    worker, *_ = endpoint
    url = worker.gateway.url
    book = worker.gateway.book
    before = book.open_sessions  # earlier tests' sessions left open
    with httpx.Client() as http:
        opened = [http.post(f"{url}/sessions").json() for _ in range(MAX_SESSIONS - before)]
        r = http.post(f"{url}/sessions")
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        for s in opened:
            http.post(f"{url}/sessions/{s['session_id']}/finish", headers={"Authorization": f"Bearer {s['api_key']}"})
    assert book.open_sessions == before and new_session(url)["session_id"]


def test_a_session_past_its_deadline_is_finished_untrained(endpoint):
    worker, *_ = endpoint
    before = worker.gateway.book.counts["sessions_no_reward"]
    s = new_session(worker.gateway.url, timeout_s=0.05)
    threading.Event().wait(1.0)  # two sweeps of the server (every 0.5 s)
    assert worker.gateway.book.counts["sessions_no_reward"] == before + 1
    r = httpx.post(f"{worker.gateway.url}/sessions/{s['session_id']}/reward", json={"reward": 1},
                   headers={"Authorization": f"Bearer {s['api_key']}"})
    assert r.status_code == 410


def test_a_weight_update_mid_call_stamps_the_later_tokens_and_the_client_sees_no_abort(endpoint):
    worker, loop, recording, _ = endpoint
    s = new_session(worker.gateway.url)
    client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    decoding, inbox = worker.decoding, worker.gateway.inbox
    for _ in range(5):  # a random model may stop (EOS) within the steps below; then the call is made again
        loop.pause()
        replies: list = []
        th = threading.Thread(target=lambda: replies.append(client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "count"}], max_tokens=12)))
        th.start()
        while inbox.in_flight < 1:
            threading.Event().wait(0.01)
        inbox.pump(decoding)
        for _ in range(3):  # the prefill step samples the first token, then one token a step: 3 at version v
            decoding.step(VERSION[0])
        VERSION[0] += 1  # the weights change between two steps; the call goes on
        loop.resume()
        th.join(60)
        (reply,) = replies
        session = worker.gateway.book.sessions[s["session_id"]]
        versions = session.episode.calls[-1].token_versions
        if len(versions) > 3:
            break
    v = VERSION[0]
    assert versions == [v - 1] * 3 + [v] * (len(versions) - 3)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_sessions_later_calls_reuse_its_prefill_and_new_weights_reuse_nothing(endpoint):
    """rollout.prefix_caching (on by default): the second call of a session extends the first, so its prompt's
    whole KV blocks (vLLM's CPU blocks hold 128 tokens) come from the cache; under another weight version (another
    salt) the same prompt is prefilled again."""
    worker, loop, recording, path = endpoint
    url, cache = worker.gateway.url, worker.prefix_cache
    # a system turn of 200 one-digit tokens: the prompt spans at least one whole block
    messages = [{"role": "system", "content": " ".join("7" * 200)}, {"role": "user", "content": "12*3?"}]

    def call(session: dict, history: list[dict]) -> tuple[object, list[int], list[int], int, int]:
        """The reply; the engine's prompt and sampled ids; the prompt tokens counted and those the cache served."""
        before = (cache.counts["gateway_prefill_tokens"], cache.counts["gateway_cached_tokens"], len(recording.log))
        reply = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0) \
            .chat.completions.create(model="any", messages=history, max_tokens=4)
        [(prompt, sampled)] = recording.log[before[2]:]
        return (reply, prompt, sampled, cache.counts["gateway_prefill_tokens"] - before[0],
                cache.counts["gateway_cached_tokens"] - before[1])

    s = new_session(url)
    first, p1, s1, prefill, cached = call(s, messages)
    assert prefill == len(p1) >= 128 and cached == 0
    history = messages + [echo(first.choices[0].message), {"role": "user", "content": "sure?"}]
    _, p2, _, prefill, cached = call(s, history)
    # the second prompt starts as the first call's ids did (the whole prompt here): every whole block of that
    # shared start is served from the cache
    first_ids = p1 + s1
    shared = next((i for i, (a, b) in enumerate(zip(p2, first_ids)) if a != b), min(len(p2), len(first_ids)))
    assert shared >= len(p1) and prefill == len(p2)
    assert cached == shared // 128 * 128 >= 384, (cached, shared)
    # the weights change: a new salt, so the same history shares nothing with the blocks of the old weights
    version = cache.version
    cache.version = lambda: version() + 1
    try:
        _, p3, _, prefill, cached = call(new_session(url), history)
    finally:
        cache.version = version
    # (a new session renders the history from its text: at least the first call's prompt is shared with p2, 3
    # whole blocks the old salt's cache holds)
    assert p3[:len(p1)] == p1 and prefill == len(p3) and cached == 0
    httpx.post(f"{url}/sessions/{s['session_id']}/finish", headers={"Authorization": f"Bearer {s['api_key']}"})


def test_a_retry_after_a_client_timeout_gets_the_first_attempts_reply_and_trains_once(endpoint):
    """A client that gives up while its call waits in the engine, then sends the same request again (as the SDK's
    retry does): the call is sampled once, recorded once, and the retry is answered with it; the session trains."""
    worker, loop, *_ = endpoint
    url, book = worker.gateway.url, worker.gateway.book
    before = dict(book.counts)
    gone, other = new_session(url, group="retried"), new_session(url, group="retried")  # the learner's group of 2
    chat = f"{url}/sessions/{gone['session_id']}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {gone['api_key']}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    loop.pause()  # the call waits in the inbox while the client's read timeout passes
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(chat, json=body, headers=auth, timeout=httpx.Timeout(10.0, read=0.5))
    loop.resume()
    session = book.sessions[gone["session_id"]]
    waiting = threading.Event()
    for _ in range(300):  # the call ends in the engine and is recorded, its client gone (polled up to 30 s)
        if session.episode.calls:
            break
        waiting.wait(0.1)
    (first,) = session.episode.calls
    assert not first.delivered and book.counts["calls"] == before["calls"] + 1
    retry = httpx.post(chat, json=body, headers=auth, timeout=30)
    assert retry.status_code == 200 and book.counts["calls_replayed"] == before["calls_replayed"] + 1
    assert retry.json()["choices"][0]["message"]["content"] == first.reply["content"]
    assert session.episode.calls == [first] and first.delivered and book.counts["calls"] == before["calls"] + 1
    rewarded = httpx.post(f"{url}/sessions/{gone['session_id']}/reward", json=1.0, headers=auth)  # a bare number
    assert rewarded.status_code == 200 and rewarded.json()["trained"] is True
    other_auth = {"Authorization": f"Bearer {other['api_key']}"}
    httpx.post(f"{url}/sessions/{other['session_id']}/v1/chat/completions", json=body, headers=other_auth, timeout=30)
    httpx.post(f"{url}/sessions/{other['session_id']}/reward", json=0.0, headers=other_auth)
    (group,) = [g for g in worker.gateway.take_groups() if g.group_id.endswith("/retried")]
    assert group.trajectories[0].response_token_ids == first.sampled_ids  # the one sample of the retried call
    assert book.counts["sessions_lost"] == before["sessions_lost"]


def test_the_same_call_twice_at_once_is_sampled_once_and_another_call_meanwhile_is_refused_409(endpoint):
    """A session's calls are one sequence: the same request sent twice while it runs gets one sample and one reply
    for both; a different request meanwhile is refused 409, naming why."""
    worker, loop, *_ = endpoint
    url, book = worker.gateway.url, worker.gateway.book
    s = new_session(url)
    chat = f"{url}/sessions/{s['session_id']}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {s['api_key']}"}
    body = {"messages": [{"role": "user", "content": "twice"}], "max_tokens": 3}
    replies: list = []
    loop.pause()
    threads = [threading.Thread(target=lambda: replies.append(httpx.post(chat, json=body, headers=auth, timeout=60)))
               for _ in range(2)]
    for th in threads:
        th.start()
    waiting = threading.Event()
    while worker.gateway.inbox.in_flight < 1 or book.counts["calls_replayed"] < 1:  # both arrived
        waiting.wait(0.01)
    busy = httpx.post(chat, json={**body, "max_tokens": 4}, headers=auth, timeout=30)
    assert busy.status_code == 409 and "one sequence" in busy.json()["error"]["message"]
    assert worker.gateway.inbox.in_flight == 1  # one engine request for the two
    loop.resume()
    for th in threads:
        th.join(60)
    assert [r.status_code for r in replies] == [200, 200] and replies[0].json() == replies[1].json()
    assert len(book.sessions[s["session_id"]].episode.calls) == 1


def test_a_streamed_reply_reaches_the_client_while_the_engine_still_samples_it(endpoint):
    """Token streaming: with the engine stopped after a few steps of a streamed call, the text sampled so far has
    already reached the SDK's stream; once the call ends, the chunks put together are the recorded reply."""
    worker, loop, _, _ = endpoint
    decoding, inbox = worker.decoding, worker.gateway.inbox
    tokenizer = worker.gateway.book.renderer.tokenizer
    heard: dict[str, list[int]] = {}

    def spy(call_id, ids):  # what the decode loop tells the inbox after each step
        heard[call_id] = ids
        type(inbox)._heard(inbox, call_id, ids)

    inbox._heard = spy
    waiting = threading.Event()
    try:
        for _ in range(5):  # a random model may stop (EOS) within the steps below; then the call is made again
            s = new_session(worker.gateway.url)
            client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
            chunks: list = []

            def read():
                for chunk in client.chat.completions.create(model="any", messages=[{"role": "user",
                                                                                     "content": "count"}],
                                                            max_tokens=16, stream=True):
                    chunks.append(chunk)

            loop.pause()
            th = threading.Thread(target=read)
            th.start()
            while inbox.in_flight < 1:
                waiting.wait(0.01)
            inbox.pump(decoding)
            (call_id,) = decoding.calls
            for _ in range(4):  # the prefill step samples the first token, then one token a step
                decoding.step(VERSION[0])
            sampled = tokenizer.decode(heard.get(call_id, []), skip_special_tokens=True).rstrip("\ufffd")
            mid_call = call_id in decoding.calls and bool(sampled)
            early = ""
            for _ in range(300 if mid_call else 0):  # the event loop sends it; the SDK reads it (polled up to 30 s)
                early = "".join(c.choices[0].delta.content or "" for c in list(chunks) if c.choices)
                if early == sampled:
                    break
                waiting.wait(0.1)
            still_sampling = call_id in decoding.calls
            loop.resume()
            th.join(60)
            if mid_call:
                break
        else:
            pytest.fail("the random model ended every call within 4 steps")
    finally:
        del inbox._heard
    assert still_sampling and early == sampled  # sent before the call ended: all the text sampled so far
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    record = worker.gateway.book.sessions[s["session_id"]].episode.calls[-1]
    assert content == record.reply["content"] and content.startswith(early)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_client_that_leaves_mid_stream_and_never_returns_is_not_trained_and_told_why(endpoint):
    """A streamed call whose client closes the connection after the first event and never retries: the call is
    recorded undelivered, and the reward's reply says the session will not train, and why."""
    worker, loop, *_ = endpoint
    url, book = worker.gateway.url, worker.gateway.book
    before = dict(book.counts)
    gone = new_session(url, group="left-stream", group_size=1)
    auth = {"Authorization": f"Bearer {gone['api_key']}"}
    loop.pause()  # the call waits in the inbox: the stream has begun, no token yet
    with httpx.stream("POST", f"{url}/sessions/{gone['session_id']}/v1/chat/completions", headers=auth, timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "stream": True}) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"role": "assistant"' in first
    loop.resume()
    session = book.sessions[gone["session_id"]]
    waiting = threading.Event()
    for _ in range(300):  # the call ends in the engine (polled up to 30 s)
        if session.episode.calls and session.calls_in_flight == 0:
            break
        waiting.wait(0.1)
    assert [c.delivered for c in session.episode.calls] == [False]
    rewarded = httpx.post(f"{url}/sessions/{gone['session_id']}/reward", json={"reward": 1.0}, headers=auth)
    assert rewarded.status_code == 200
    assert rewarded.json()["trained"] is False and "reached its client" in rewarded.json()["reason"]
    assert book.counts["calls_undelivered"] >= before["calls_undelivered"] + 1
    assert not [g for g in worker.gateway.take_groups() if g.group_id.endswith("/left-stream")]
