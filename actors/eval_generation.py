"""Generation for evaluation and checks, on a rollout worker's engine between training runs.

The evaluation harness (cluster/evaluation.py) and the weight-sync checks call these through `RolloutWorker`.
They do not go through the decode loop (actors/decode_loop.py): no weights change while they run, so they need
no safe points or version stamps, and vLLM's batch `generate` with `n` samples per prompt and one seed per
prompt keeps each prompt's draws independent of how the prompts were split over workers.
"""

import zlib

from protocols.trajectory import Prompt


def greedy_texts(llm, prompts: list[Prompt], max_tokens: int) -> list[str]:
    """One greedy response per prompt, as text."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p.prompt_token_ids} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def sample_responses(llm, prompts: list[Prompt], n: int, temperature: float, top_p: float, seed: int,
                     max_tokens: int) -> list[list[dict]]:
    """`n` responses per prompt (temperature 0 is greedy). Each prompt's sampling is seeded from `seed` and its
    prompt id. Per prompt, per response: text, tokens, finish_reason."""
    from vllm import SamplingParams

    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
                             max_tokens=max_tokens,
                             seed=zlib.crc32(f"eval/{seed}/{p.prompt_id}".encode()) & 0x7FFFFFFF)
              for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p.prompt_token_ids} for p in prompts], params, use_tqdm=False)
    return [[{"text": o.text, "tokens": len(o.token_ids),
              "finish_reason": "length" if o.finish_reason == "length" else "stop"} for o in out.outputs]
            for out in outs]


def sequence_logprobs(llm, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
    """log p(response token) under the engine's current weights at temperature 1 (prompt log-probs are computed
    from raw logits)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
    inputs = [{"prompt_token_ids": p + r} for p, r in zip(prompt_ids, response_ids)]
    outs = llm.generate(inputs, params, use_tqdm=False)
    result = []
    for out, p, r in zip(outs, prompt_ids, response_ids):
        lps = out.prompt_logprobs[len(p):len(p) + len(r)]
        result.append([lp[tok].logprob for lp, tok in zip(lps, r)])
    return result
