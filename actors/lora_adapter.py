"""A rollout engine's LoRA adapter (model.lora.rank > 0): the weights a worker receives are the adapter alone
(weights/lora.py), written to a folder of the worker's own and loaded into the engine, and every request the
engine runs (rollouts, the weight-sync probe, evaluation) carries that adapter.

One adapter id per engine, replaced in place (`load_inplace`), rather than a new id per version. The worker loads
newer weights between two decode steps and stamps each step's tokens with the version it holds
(actors/rollout_worker.py); a replace in place makes every request in flight decode its next token with the new
adapter, just as a full-weight reload does, so that stamp stays the version that sampled each token and nothing
else changes: the importance ratio, the staleness limits and the sync check read the same version (as after a
full-weight reload, the keys and values of tokens already processed stay those of the old adapter;
tests/test_lora_engine.py checks a request switched mid-sample token by token). With a new id
per version a request would keep the adapter it started with (its LoRARequest is fixed at admission): its tokens
would need its own version instead of the engine's, the engine would hold one adapter slot per version still in
flight (`max_loras`; on CPU each slot costs decode time), and partial rollouts would silently stop taking new
weights mid-sample. The requests carry the id with `load_inplace` off, so a decode step only touches the loaded
adapter; prefix caching stays off (actors/rollout_worker.py), since KV computed under the old adapter must not be
reused.

Before the first version arrives the engine holds version 0: an all-zero adapter (the base model, which is what
peft's initial adapter computes too), so every request carries an adapter from the start and none switches from
the base model to an adapter mid-sample.
"""

import tempfile
from typing import Any

import torch

from protocols.lora import LoraConfig
from weights.lora import AdapterFolders, zero_adapter

ADAPTER_NAME = "relayrl-policy"
ADAPTER_ID = 1
"""vLLM's name and integer id of the policy's adapter in every engine (ids start at 1)."""


def lora_engine_args(lora: LoraConfig) -> dict:
    """`LLM(...)` arguments of an engine that serves the policy's adapter: one adapter slot, sized to its rank
    (on CPU decoding slows as max_lora_rank grows past the adapter's rank)."""
    if not lora.enabled:
        return {}
    return {"enable_lora": True, "max_lora_rank": lora.engine_max_rank, "max_loras": 1}


class EngineAdapter:
    """The adapter an engine holds, and the LoRARequest its requests carry."""

    def __init__(self, llm: Any, lora: LoraConfig, model_path: str, worker_id: int,
                 trust_remote_code: bool = False) -> None:
        self.llm = llm
        self.folders = AdapterFolders(tempfile.mkdtemp(prefix=f"relayrl-lora-worker{worker_id}-"), lora, model_path)
        """Where each loaded version's adapter is written (vLLM loads adapters from disk); older ones removed."""
        self.loads = 0
        self.request = None
        """The LoRARequest of the loaded adapter (load_inplace off), for every request the engine runs."""
        self.load(zero_adapter(model_path, lora, trust_remote_code))

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Write the adapter `weights` (peft saved names) to a new folder and replace the engine's adapter in
        place with it; requests in flight decode their next token with it."""
        from vllm.lora.request import LoRARequest

        folder = self.folders.write(self.loads, weights)
        self.loads += 1
        self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(folder), load_inplace=True))
        self.request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(folder))
        self.folders.loaded(folder)

    def close(self) -> None:
        self.folders.close()


class AdapterRequests:
    """The engine as the decode loop and the probe see it (actors/decode_loop.py `Engine`): every request added
    carries the loaded adapter."""

    def __init__(self, engine: Any, adapter: EngineAdapter) -> None:
        self.engine = engine
        self.adapter = adapter

    def add_request(self, request_id: str, prompt: dict, params: Any) -> None:
        self.engine.add_request(request_id, prompt, params, lora_request=self.adapter.request)

    def step(self) -> list:
        return self.engine.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
