"""Generation for evaluation and checks, on a rollout worker's engine between training runs.

The evaluation harness (cluster/evaluation.py) and the weight-sync checks call these through `RolloutWorker`.
Single-turn generation does not go through the decode loop (actors/decode_loop.py): no weights change while it
runs, so it needs no safe points or version stamps, and vLLM's batch `generate` with `n` samples per prompt and
one seed per prompt keeps each prompt's draws independent of how the prompts were split over workers. With tools
(cfg.tools), evaluation runs the training's agent loop (`agent_responses`): the same stop strings, tool pool,
budgets and rendering, with one seed per sample and turn.
"""

import zlib
from typing import Any

from actors.decode_loop import DecodeLoop, SampleInFlight
from actors.prefix_cache import salted
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt, Trajectory
from rewards.tool_calls import stop_strings


def tool_stops(tools: ToolsConfig) -> dict:
    """SamplingParams arguments that end a model turn right after a tool call's closing tag, kept in the output
    (the agent loop parses it; the model's tokens are taken as sampled, never re-tokenized). None without tools."""
    return {"stop": stop_strings(tools), "include_stop_str_in_output": True} if tools.enabled else {}


def greedy_texts(llm, prompts: list[Prompt], max_tokens: int, lora_request: Any = None,
                 cache_salt: str | None = None) -> list[str]:
    """One greedy response per prompt, as text. `lora_request`: the engine's adapter (model.lora), else None;
    `cache_salt`: the prefix cache's salt for the loaded weights (actors/prefix_cache.py), else None."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(salted([{"prompt_token_ids": p.prompt_token_ids} for p in prompts], cache_salt), params,
                        use_tqdm=False, lora_request=lora_request)
    return [o.outputs[0].text for o in outs]


def sample_responses(llm, prompts: list[Prompt], n: int, temperature: float, top_p: float, seed: int,
                     max_tokens: int, lora_request: Any = None, cache_salt: str | None = None) -> list[list[dict]]:
    """`n` responses per prompt (temperature 0 is greedy). Each prompt's sampling is seeded from `seed` and its
    prompt id. Per prompt, per response: text, tokens, finish_reason."""
    from vllm import SamplingParams

    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                             max_tokens=max_tokens,
                             seed=zlib.crc32(f"eval/{seed}/{p.prompt_id}".encode()) & 0x7FFFFFFF)
              for p in prompts]
    outs = llm.generate(salted([{"prompt_token_ids": p.prompt_token_ids} for p in prompts], cache_salt), params,
                        use_tqdm=False, lora_request=lora_request)
    return [[{"text": o.text, "tokens": len(o.token_ids),
              "finish_reason": "length" if o.finish_reason == "length" else "stop"} for o in out.outputs]
            for out in outs]


def agent_responses(engine: Any, agent: Any, prompts: list[Prompt], n: int, temperature: float, top_p: float,
                    seed: int, max_tokens: int) -> list[list[Trajectory]]:
    """`n` multi-turn responses per prompt through `agent` (an actors/agent_loop.py AgentLoop) on vLLM's
    `LLMEngine`, in prompt order. Each request is seeded from `seed`, the prompt id, the sample and the turn."""
    from vllm import SamplingParams

    def params(sample: SampleInFlight, tokens: int) -> Any:
        key = f"eval/{seed}/{sample.prompt.prompt_id}/{sample.index}/{sample.requests_ended}"
        return SamplingParams(n=1, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                              max_tokens=tokens, logprobs=0, seed=zlib.crc32(key.encode()) & 0x7FFFFFFF,
                              **tool_stops(agent.cfg))

    loop = DecodeLoop(engine, params, n, max_tokens, worker_id=0, on_request_end=agent)
    for i, prompt in enumerate(prompts):
        loop.start_group(f"eval/{i}", prompt)
    done: dict[str, list[Trajectory]] = {}
    while loop.has_unfinished():
        done.update((group.group_id, group.trajectories) for group in loop.step(0))
    return [done[f"eval/{i}"] for i in range(len(prompts))]


def response_row(trajectory: Trajectory) -> dict:
    """A multi-turn response as `sample_responses` gives one: `text` is what the verifier scores (the final
    answer, after the last tool segment); `response` the whole text, tool segments included."""
    return {"text": trajectory.final_text, "tokens": len(trajectory.response_token_ids),
            "finish_reason": trajectory.finish_reason, "response": trajectory.response_text,
            "tool_calls": len(trajectory.tool_calls or [])}


def sequence_logprobs(llm, prompt_ids: list[list[int]], response_ids: list[list[int]],
                      lora_request: Any = None, cache_salt: str | None = None) -> list[list[float]]:
    """log p(response token) under the engine's current weights at temperature 1 (prompt log-probs are computed
    from raw logits)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    inputs = salted([{"prompt_token_ids": p + r} for p, r in zip(prompt_ids, response_ids)], cache_salt)
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_request)
    result = []
    for out, p, r in zip(outs, prompt_ids, response_ids):
        lps = out.prompt_logprobs[len(p):len(p) + len(r)]
        result.append([lp[tok].logprob for lp, tok in zip(lps, r)])
    return result
