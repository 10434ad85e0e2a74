"""The engine side of LoRA's in-place replace (actors/lora_adapter.py), on a real vLLM engine in this process: a request
in flight when the adapter is replaced samples its earlier tokens under the old adapter and every later one under the
new, which is what the worker's per-step version stamp assumes. As with a full-weight reload mid-sample, the keys and
values of the tokens already processed stay those computed under the old adapter: the reference here is transformers
+ peft run the same way (old adapter up to the switch, its KV cache kept, new adapter after)."""

import pytest
import torch

from protocols.lora import LoraConfig
from weights.lora import zero_adapter

pytestmark = pytest.mark.slow

LORA = LoraConfig(rank=4, alpha=8)


def _random_adapter(path: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(name, 0.3 * torch.randn(t.shape, generator=g)) for name, t in zero_adapter(path, LORA)]


def _switched_reference(path: str, prompt: list[int], tokens: list[int], k: int, first, second) -> list[float]:
    """Log-probs of tokens[k:] from transformers + peft: the prompt and tokens[:k-1] run under `first` (the engine
    had computed their keys and values before the switch), then tokens[k-1:] under `second` on that KV cache."""
    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from weights.lora import peft_config

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), peft_config(LORA)).eval()
    ids = prompt + tokens
    cut = len(prompt) + k - 1
    with torch.no_grad():
        set_peft_model_state_dict(model, dict(first))
        cache = model(torch.tensor([ids[:cut]]), use_cache=True).past_key_values
        set_peft_model_state_dict(model, dict(second))
        logits = model(torch.tensor([ids[cut:-1]]), past_key_values=cache, use_cache=True).logits[0]
    rows = torch.log_softmax(logits.float(), dim=-1)
    return [float(rows[i, token]) for i, token in enumerate(tokens[k:])]


def test_a_request_in_flight_switches_adapter_at_its_next_step(tiny_models):
    from vllm import LLM, SamplingParams

    from actors.eval_generation import sequence_logprobs
    from actors.lora_adapter import AdapterRequests, EngineAdapter, lora_engine_args

    path = tiny_models["untied"]
    llm = LLM(model=path, dtype="float32", seed=0, gpu_memory_utilization=0.1, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=4096, enforce_eager=True, enable_prefix_caching=False,
              logprobs_mode="processed_logprobs", **lora_engine_args(LORA))
    adapter = EngineAdapter(llm, LORA, path, worker_id=0)
    first, second = _random_adapter(path, 1), _random_adapter(path, 2)
    adapter.load(first)
    engine = AdapterRequests(llm.llm_engine, adapter)
    prompt = [1, 3, 13, 5, 14]
    engine.add_request("r", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=7, ignore_eos=True))
    before_switch = 4
    for _ in range(before_switch):  # the first step prefills and samples one token; each later one samples one
        engine.step()
    adapter.load(second)  # replaced in place while the request is in flight
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    sample = final.outputs[0]
    tokens = list(sample.token_ids)
    sampled = [row[token].logprob for row, token in zip(sample.logprobs, tokens)]
    assert len(tokens) == 12

    def scored_under(weights):
        adapter.load(weights)
        return sequence_logprobs(llm, [prompt], [tokens], adapter.request)[0]

    under_first, under_second = scored_under(first), scored_under(second)
    # the two adapters give clearly different log-probs, so matching one of them says which one sampled
    assert max(abs(a - b) for a, b in zip(under_first[before_switch:], under_second[before_switch:])) > 1e-2
    torch.testing.assert_close(torch.tensor(sampled[:before_switch]), torch.tensor(under_first[:before_switch]),
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor(sampled[before_switch:]),
                               torch.tensor(_switched_reference(path, prompt, tokens, before_switch, first, second)),
                               rtol=0, atol=1e-4)
    # only the folder of the adapter held stays on disk
    assert len(adapter.folders.written) == 1 and adapter.folders.written[0].exists()
    adapter.close()
