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


class RankWeights:
    """Needs `self.engine` (the DeepSpeed engine), `self.cfg`, `self.rank`, `self.use_cuda`, `self.tied`,
    `self.model_path` and `self._device()`; call `init_weights_out()` in the constructor."""

    def init_weights_out(self) -> None:
        self.weight_sender = weight_backend(self.cfg).sender(self.cfg, self.use_cuda)
        """Rank 0's sender of the configured transport (built on every rank; only rank 0 sends)."""

    def _full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model in HF checkpoint names on rank 0 (None elsewhere). Collective under ZeRO-3."""
        module = self.engine.module
        if self.cfg.learner.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                state = self._host_copy(module) if self.rank == 0 else None
        else:
            state = self._host_copy(module) if self.rank == 0 else None
        if state is not None and self.tied and "lm_head.weight" not in state:
            # Tied embeddings: send lm_head explicitly so the engine's separate copy is refreshed too.
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return state

    def _host_copy(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        # From a GPU, .cpu() already copies (a second clone doubled the publish time on an H100). On CPU the
        # state dict aliases the live parameters and, under ZeRO-3, gathered storage freed on exit: clone it.
        if self.use_cuda:
            return {k: v.detach().cpu() for k, v in module.state_dict().items()}
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

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

        limit = self.cfg.weight_sync.bucket_mb * 2**20
        chunk, size = [], 0
        for i, (name, param) in enumerate(named):
            chunk.append((name, param))
            size += param.ds_numel * param.element_size()
            if size < limit and i + 1 < len(named):
                continue
            unique = list({id(p): p for _, p in chunk}.values())
            with deepspeed.zero.GatheredParameters(unique, modifier_rank=None):
                for chunk_name, chunk_param in chunk:
                    yield chunk_name, chunk_param.detach()
                if self.use_cuda:
                    # Copies out of the gathered storage must land before the gather frees it.
                    torch.cuda.current_stream().synchronize()
            chunk, size = [], 0

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
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
                parts = self._lora_parts(module) if self.rank == 0 else None
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

    @staticmethod
    def _lora_parts(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
        """(the merged model's state, the adapter's saved-name tensors), host copies taken while whole."""
        with torch.no_grad():
            return merged_state_dict(module), [(n, p.detach().to("cpu").clone()) for n, p in adapter_params(module)]
