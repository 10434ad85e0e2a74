"""A learner rank's weights going out: to the rollout engines (through the sender of the transport that
`weight_sync.type` names; weights/transport.py) and to a Hugging Face folder.

`LearnerRank` (learner/learner_actor.py) mixes this in, so these stay remote methods of the rank. Under ZeRO-3
every method that reads the weights is collective: all ranks call it together, since the parameters are
gathered a bucket at a time.
"""

import torch

from protocols.weight_announcement import WeightAnnouncement
from weights.backends import weight_backend
from weights.lora import ADAPTER_SUBFOLDER, adapter_params, merged_state_dict, save_merged, write_adapter
from weights.transport import group_address


def buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices of `sizes` (bytes) in buckets that each close once they reach `limit` bytes: a bucket
    holds less than `limit` plus its last entry (one entry larger than `limit` is a bucket of its own)."""
    out, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total >= limit:
            out.append(current)
            current, total = [], 0
    return out + ([current] if current else [])


class RankWeights:
    """Needs `self.engine` (the DeepSpeed engine), `self.cfg`, `self.rank`, `self.use_cuda`, `self.tied`,
    `self.model_path` and `self._device()`; call `init_weights_out()` in the constructor."""

    def init_weights_out(self) -> None:
        self.weight_sender = weight_backend(self.cfg).sender(self.cfg, self.use_cuda)
        """Rank 0's sender of the configured transport (built on every rank; only rank 0 sends)."""

    def _full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model in HF checkpoint names on rank 0 (None elsewhere), as host copies. Collective under
        ZeRO-3, where it is gathered `weight_sync.bucket_mb` at a time (`_gathered_state_dict`)."""
        module = self.engine.module
        if self.cfg.learner.zero_stage == 3:
            state = self._gathered_state_dict(module)
        else:
            state = self._host_copy(module.state_dict()) if self.rank == 0 else None
        if state is not None and self.tied and "lm_head.weight" not in state:
            # Tied embeddings: send lm_head explicitly so the engine's separate copy is refreshed too.
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def _gathered_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: the module's state dict on rank 0, its entries gathered a bucket of `weight_sync.bucket_mb`
        at a time (in state-dict order) and copied to the host before the next gather, so no rank holds more
        than one bucket of gathered parameters beyond its shard. Every rank enters every gather."""
        import deepspeed

        keys = list(module.state_dict().keys())  # outside a gather: the names, over empty partitioned tensors
        params = dict(module.named_parameters(remove_duplicate=False))
        sizes = [params[k].ds_numel * params[k].element_size() if k in params else 0 for k in keys]
        state: dict[str, torch.Tensor] = {}
        for bucket in buckets(sizes, self.cfg.weight_sync.bucket_mb * 2**20):
            names = [keys[i] for i in bucket]
            unique = list({id(params[n]): params[n] for n in names if n in params}.values())
            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
                if self.rank == 0:
                    whole = module.state_dict()  # this bucket's entries whole, the rest still partitioned
                    state.update(self._host_copy({n: whole[n] for n in names}))
        return state if self.rank == 0 else None

    def _host_copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # From a GPU, .cpu() already copies (a second clone doubled the publish time on an H100). On CPU the
        # state dict aliases the live parameters and, under ZeRO-3, gathered storage freed on exit: clone it.
        if self.use_cuda:
            return {k: v.detach().cpu() for k, v in tensors.items()}
        return {k: v.detach().clone() for k, v in tensors.items()}

    def _weight_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self.cfg.model.lora.enabled:
            # model.lora: the adapter alone, in peft's saved names; the base model never changes (weights/lora.py)
            return adapter_params(self.engine.module)
        # remove_duplicate=False lists a tied lm_head under its own name: vLLM's CPU backend needs it loaded too.
        return list(self.engine.module.named_parameters(remove_duplicate=False))

    def _iter_weights(self):
        """(name, tensor) in checkpoint names, in a fixed order, live views of the parameters. Under ZeRO-3 the
        parameters are gathered `weight_sync.bucket_mb` at a time and released after the consumer has read
        them, so the whole model is never materialized at once. Every rank must iterate it to the end (the
        gathers are collectives); only rank 0's consumer uses the tensors."""
        named = self._weight_params()
        if self.cfg.learner.zero_stage != 3:
            for name, param in named:
                yield name, param.detach()
            return
        import deepspeed

        sizes = [param.ds_numel * param.element_size() for _, param in named]
        for bucket in buckets(sizes, self.cfg.weight_sync.bucket_mb * 2**20):
            chunk = [named[i] for i in bucket]
            unique = list({id(p): p for _, p in chunk}.values())
            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
                for chunk_name, chunk_param in chunk:
                    yield chunk_name, chunk_param.detach()
                if self.use_cuda:
                    # Copies out of the gathered storage must land before the gather frees it.
                    torch.cuda.current_stream().synchronize()

    def weight_metas(self) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, full shape) of every tensor the transport sends, in order (no gather needed)."""
        out = []
        for name, param in self._weight_params():
            shape = tuple(getattr(param, "ds_shape", param.shape))
            out.append((name, str(param.dtype).removeprefix("torch."), list(shape)))
        return out

    def weight_group_address(self) -> tuple[str, int]:
        """Host and a free port on this rank's own node, for the weight group's store (rank 0 serves it)."""
        return group_address()

    def join_weight_group(self, info: dict) -> str:
        """Rank 0 joins the weight group as its rank 0 (the engines join at the same time), for a transport that
        forms one (`WeightBackend.group_info`)."""
        if self.rank != 0:
            return "not a member"
        self.weight_sender.join(info, self._device())
        return "joined"

    def publish_weights(self, version: int = 0) -> WeightAnnouncement | None:
        """Send the current weights as `version` through the configured transport. Rank 0 returns the
        announcement (object_store: its refs hold the object ref; collective: refs=[], the engines already hold
        the weights). Other ranks return None."""
        weights = self._iter_weights()
        if self.rank != 0:
            for _ in weights:  # join the ZeRO-3 gathers
                pass
            return None
        return self.weight_sender.publish(weights, version)

    def save_hf(self, folder: str) -> str | None:
        """Write the model in Hugging Face format (rank 0). Collective under ZeRO-3. With LoRA: the merged model
        (base + adapter, what transformers and vLLM load without peft) and, in `adapter/`, the adapter in peft
        format."""
        if self.cfg.model.lora.enabled:
            return self._save_lora(folder)
        state = self._full_state_dict()
        if state is None:
            return None
        from transformers import AutoTokenizer

        # Under ZeRO-3 the module's own parameters are partitioned; the gathered state dict is what gets written.
        self.engine.module.save_pretrained(folder, state_dict=state)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(folder)
        return folder

    def _save_lora(self, folder: str) -> str | None:
        module = self.engine.module
        if self.cfg.learner.zero_stage == 3:
            parts = self._gathered_lora_parts(module)
        else:
            parts = self._lora_parts(module) if self.rank == 0 else None
        if parts is None:
            return None
        from transformers import AutoTokenizer

        merged, adapter = parts
        save_merged(folder, module, merged)
        write_adapter(f"{folder}/{ADAPTER_SUBFOLDER}", adapter, self.cfg.model.lora, self.model_path)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(folder)
        return folder

    def _gathered_lora_parts(self, module: torch.nn.Module):
        """ZeRO-3: `_lora_parts` on rank 0 (None elsewhere), gathered a bucket of `weight_sync.bucket_mb` at a
        time: each base weight with the adapter matrices of its layer, merged and copied to the host in its
        bucket; then the adapter alone (small by design). Every rank enters every gather."""
        import deepspeed

        base = module.get_base_model()
        keys = [k for k in base.state_dict() if ".lora_" not in k]
        params = dict(base.named_parameters(remove_duplicate=False))
        adapters: dict[str, list[torch.nn.Parameter]] = {}  # layer name -> its adapter matrices
        for name, param in params.items():
            if ".lora_" in name:
                adapters.setdefault(name.split(".lora_")[0], []).append(param)
        needs = {k: [params[k]] if k in params else [] for k in keys}  # buffers: not partitioned, no gather
        for k in keys:
            if k.endswith(".base_layer.weight"):  # merging needs the layer's adapter matrices beside it
                needs[k] += adapters.get(k.removesuffix(".base_layer.weight"), [])
        sizes = [sum(p.ds_numel * p.element_size() for p in needs[k]) for k in keys]
        merged: dict[str, torch.Tensor] = {}
        for bucket in buckets(sizes, self.cfg.weight_sync.bucket_mb * 2**20):
            names = [keys[i] for i in bucket]
            unique = list({id(p): p for n in names for p in needs[n]}.values())
            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None), torch.no_grad():
                if self.rank == 0:
                    merged.update(merged_state_dict(module, only=set(names)))
        adapter = adapter_params(module)
        with deepspeed.zero.GatheredParameters([p for _, p in adapter], modifier_rank=None):
            weights = [(n, p.detach().to("cpu").clone()) for n, p in adapter] if self.rank == 0 else None
        return (merged, weights) if self.rank == 0 else None

    @staticmethod
    def _lora_parts(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
        """(the merged model's state, the adapter's saved-name tensors), host copies taken while whole."""
        with torch.no_grad():
            return merged_state_dict(module), [(n, p.detach().to("cpu").clone()) for n, p in adapter_params(module)]
