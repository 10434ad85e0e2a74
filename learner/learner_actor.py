"""One DeepSpeed data-parallel rank of the learner, hosted in a Ray actor.

The driver sends each rank its shard of the global batch (whole samples, advantages already computed on the
whole batch); every rank runs the same number of micro-batches, then one optimizer step. Loss values are shares
of the global loss (global normalizers), scaled by the world size because DeepSpeed averages gradients over
ranks: the summed gradient is then the same for 1 or N ranks. Weights leave through the transport that
`weight_sync.type` names (learner/weight_transport.py): the Ray object store, or a broadcast to the engines.
"""

import os
import time

import torch

from learner.batch import collate, pad_per_token, response_logits, token_logprobs
from learner.objective import (
    LossNormalizer,
    PolicyLossInputs,
    compute_policy_loss,
    entropy_from_logits,
    needs_ref_logprobs,
)
from learner.weight_transport import CollectiveSender, HostBuffers, host_arrays, packed_num_bytes
from learner.weight_wire import BucketLayout, WeightMeta, open_weight_group
from protocols.config import RunConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def micro_batches(num_samples: int, micro_batch_size: int) -> list[slice]:
    return [slice(i, min(i + micro_batch_size, num_samples)) for i in range(0, num_samples, micro_batch_size)]


class LearnerRank:
    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str) -> None:
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.model_path = model_path
        self.use_cuda = torch.cuda.is_available() and cfg.cluster.use_gpus
        if not self.use_cuda:
            os.environ["DS_ACCELERATOR"] = "cpu"
        self.engine = None
        self.host_buffers = HostBuffers(pin_memory=self.use_cuda)
        self.weight_sender: CollectiveSender | None = None

    def node_address(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group and build the DeepSpeed engine. All ranks must call it together."""
        import deepspeed
        from transformers import AutoModelForCausalLM

        cfg = self.cfg
        backend = cfg.learner.backend if cfg.learner.backend != "auto" else ("nccl" if self.use_cuda else "gloo")
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                                   rank=self.rank, world_size=self.world_size,
                                   init_method=f"tcp://{master_addr}:{master_port}")
        torch.manual_seed(cfg.train.seed)
        dtype = DTYPES[cfg.model.dtype]
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype,
                                                     trust_remote_code=cfg.model.trust_remote_code)
        if cfg.learner.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.ref_model = None
        if needs_ref_logprobs(cfg.algorithm):
            # Frozen initial policy for the KL term. A separate reference worker group replaces this for big models.
            self.ref_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).eval()
            self.ref_model.requires_grad_(False)
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.hf_config = model.config
        per_rank = cfg.samples_per_step // self.world_size
        self.num_micro = len(micro_batches(per_rank, cfg.learner.micro_batch_size))
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, betas=cfg.learner.betas,
                                      weight_decay=cfg.learner.weight_decay)
        ds_config = {
            "train_micro_batch_size_per_gpu": min(cfg.learner.micro_batch_size, per_rank),
            "gradient_accumulation_steps": self.num_micro,
            "gradient_clipping": cfg.learner.max_grad_norm,
            "zero_optimization": {"stage": cfg.learner.zero_stage},
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
            "fp16": {"enabled": cfg.model.dtype == "float16"},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        return self.num_micro

    # --- scoring ---------------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return self.engine.device if self.use_cuda else torch.device("cpu")

    def _to(self, batch):
        dev = self._device()
        for name in ("input_ids", "attention_mask", "position_ids", "loss_mask", "response_ids"):
            setattr(batch, name, getattr(batch, name).to(dev))
        return batch

    @torch.no_grad()
    def ref_logprobs(self, shard: dict) -> list[list[float]]:
        """Reference-policy log-probs of each response token (for KL placed in the reward)."""
        out = []
        for sl in micro_batches(len(shard["prompt_ids"]), self.cfg.learner.micro_batch_size):
            batch = self._to(collate(shard["prompt_ids"][sl], shard["response_ids"][sl], self.pad_id))
            lps = token_logprobs(response_logits(self.ref_model, batch, self.cfg.rollout.temperature),
                                 batch.response_ids)
            out.extend(row[: len(r)].tolist() for row, r in zip(lps.cpu(), shard["response_ids"][sl]))
        return out

    @torch.no_grad()
    def policy_logprobs(self, shard: dict) -> list[list[float]]:
        """Current-policy log-probs of each response token (weight-sync checks, proximal recompute)."""
        self.engine.eval()
        out = []
        for sl in micro_batches(len(shard["prompt_ids"]), self.cfg.learner.micro_batch_size):
            batch = self._to(collate(shard["prompt_ids"][sl], shard["response_ids"][sl], self.pad_id))
            lps = token_logprobs(response_logits(self.engine, batch, self.cfg.rollout.temperature), batch.response_ids)
            out.extend(row[: len(r)].tolist() for row, r in zip(lps.cpu(), shard["response_ids"][sl]))
        self.engine.train()
        return out

    # --- the update ----------------------------------------------------------------------------------------------
    def train_step(self, shard: dict, normalizer: LossNormalizer) -> dict[str, float]:
        """One optimizer step on this rank's shard. `shard` holds per-sample lists: prompt_ids, response_ids,
        behavior_logprobs, advantages (per token), sample_mask. Returns summed metrics (see finalize_metrics)."""
        cfg = self.cfg
        start = time.perf_counter()
        slices = micro_batches(len(shard["prompt_ids"]), cfg.learner.micro_batch_size)
        if len(slices) != self.num_micro:
            raise ValueError(f"rank {self.rank} got {len(shard['prompt_ids'])} samples: {len(slices)} micro-batches, "
                             f"but DeepSpeed was set up for {self.num_micro}; every step must send the same count")
        summed: dict[str, float] = {}
        self.engine.train()
        for sl in slices:
            batch = self._to(collate(shard["prompt_ids"][sl], shard["response_ids"][sl], self.pad_id))
            width = batch.loss_mask.size(1)
            sample_mask = torch.tensor(shard["sample_mask"][sl], dtype=torch.bool, device=batch.loss_mask.device)
            loss_mask = batch.loss_mask & sample_mask[:, None]
            logits = response_logits(self.engine, batch, cfg.rollout.temperature)
            logprobs = token_logprobs(logits, batch.response_ids)
            if cfg.algorithm.entropy_coef > 0:
                entropy = entropy_from_logits(logits)
            else:
                with torch.no_grad():
                    entropy = entropy_from_logits(logits.detach())
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = token_logprobs(response_logits(self.ref_model, batch, cfg.rollout.temperature),
                                         batch.response_ids)
            dev = logprobs.device
            inputs = PolicyLossInputs(
                behavior_logprobs=pad_per_token(shard["behavior_logprobs"][sl], width).to(dev),
                advantages=pad_per_token(shard["advantages"][sl], width).to(dev),
                loss_mask=loss_mask,
                # One optimizer step per batch: the policy before the update is the one computing `logprobs`,
                # so the proximal log-probs of decoupled PPO come free, without a second forward pass.
                proximal_logprobs=logprobs.detach(),
                ref_logprobs=ref,
                entropy=entropy,
            )
            loss, metrics = compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)
            # DeepSpeed averages gradients over ranks; the loss is this micro-batch's share of the global sum.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            self.engine.step()
            for key, value in metrics.items():
                value = float(value)
                summed[key] = max(summed.get(key, value), value) if key.endswith("_max") else summed.get(key, 0.0) + value
        grad_norm = self.engine.get_global_grad_norm()
        summed["grad_norm_max"] = float(grad_norm) if grad_norm is not None else 0.0
        summed["learner_seconds_max"] = time.perf_counter() - start
        return summed

    # --- weights out -------------------------------------------------------------------------------------------
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
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join_weight_group(self, info: dict) -> str:
        """Rank 0 joins the collective weight group as its rank 0 (the engines join at the same time)."""
        if self.rank != 0:
            return "not a member"
        device = self._device() if info["backend"] == "nccl" else torch.device("cpu")
        metas = [WeightMeta(n, d, tuple(s)) for n, d, s in info["metas"]]
        group, store = open_weight_group(info["host"], info["port"], 0, info["world_size"], info["backend"],
                                  info["timeout_s"], device)
        self.weight_sender = CollectiveSender(group, store, BucketLayout(metas, info["bucket_bytes"]), device,
                                              info["timeout_s"])
        return "joined"

    def publish_weights(self, version: int = 0) -> dict | None:
        """Send the current weights as `version`. object_store: one `ray.put` of reused host buffers, rank 0
        returns {refs, num_tensors, num_bytes, seconds}. collective: rank 0 broadcasts to the weight group and
        returns the same with refs=[] (the engines already hold the weights). Other ranks return None."""
        import ray

        start = time.perf_counter()
        weights = self._iter_weights()
        if self.rank != 0:
            for _ in weights:  # join the ZeRO-3 gathers
                pass
            return None
        if self.cfg.weight_sync.type == "collective":
            if self.weight_sender is None:
                raise RuntimeError("weight_sync.type=collective but the learner has not joined the weight group; "
                                   "the trainer calls LearnerGroup.join_weight_group after starting the workers")
            sent = self.weight_sender.send(weights, version)
            return {"refs": [], **sent, "seconds": time.perf_counter() - start}
        # CPU parameters under ZeRO-2 are host memory already and stay put until the put returns: no extra copy.
        reuse = self.use_cuda or self.cfg.learner.zero_stage == 3
        packed = host_arrays(weights, self.host_buffers if reuse else None)
        ref = ray.put(packed)
        return {"refs": [ref], "num_tensors": len(packed), "num_bytes": packed_num_bytes(packed),
                "seconds": time.perf_counter() - start}

    def save_hf(self, folder: str) -> str | None:
        """Write the model in Hugging Face format (rank 0). Collective under ZeRO-3."""
        state = self._full_state_dict()
        if state is None:
            return None
        from transformers import AutoTokenizer

        # Under ZeRO-3 the module's own parameters are partitioned; the gathered state dict is what gets written.
        self.engine.module.save_pretrained(folder, state_dict=state)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(folder)
        return folder

    def ping(self) -> int:
        return self.rank
