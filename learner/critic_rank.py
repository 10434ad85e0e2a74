"""One DeepSpeed rank of the critic (PPO's value model), hosted by a Ray actor (actors/critic_worker.py).

The ranks train together: ZeRO-2 data parallelism on gloo (CPU) or NCCL (GPUs), their own AdamW, learning rate
and linear warm-up, the clipped value loss (learner/value_loss.py) with a global token normalizer, so the
gradient is the same for 1 or N ranks. Between updates each rank alone computes values for trajectories in the
stream (ZeRO-2 keeps the full parameters on every rank, so a forward needs no collective).
"""

import time
from pathlib import Path

import torch

from learner.lr_schedule import warmup_factor
from learner.micro_batches import sample_count_micro_batches
from learner.rank_setup import DTYPES, DeepSpeedRank, deepspeed_config
from learner.shard_scoring import collate_micro_batch
from learner.startup_heap import frozen_after_imports
from learner.value_loss import clipped_value_loss
from learner.value_model import ValueModel, response_values
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch

HEAD_FILE = "value_head.pt"
"""The value head's state dict inside a saved critic folder (the body is a Hugging Face model beside it)."""


def warmup_lr(lr: float, warmup_steps: int, update: int) -> float:
    """Learning rate of update `update` (0-based): the policy's linear warm-up (learner/lr_schedule.py)."""
    return lr * warmup_factor(update, warmup_steps)


class CriticRank(DeepSpeedRank):
    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str) -> None:
        """model_path: the critic's folder (critic.model_path, or the policy's when that is empty)."""
        super().__init__(cfg, rank, world_size, model_path)
        self.version = 0
        """Critic updates taken; stamped on the values this rank computes."""

    def setup(self, master_addr: str, master_port: int, module_state: dict | None = None, version: int = 0) -> int:
        """Join the critic's process group and build its DeepSpeed engine. Every rank must call it together.
        module_state: full weights (`module_state()` of a rank of an earlier group) to start from instead of
        model_path's; version: the update count to continue from (a restarted group keeps its version)."""
        with frozen_after_imports():
            import deepspeed
            from transformers import AutoModel

        cfg, c = self.cfg, self.cfg.critic
        self._join_process_group(deepspeed, master_addr, master_port,
                                 "nccl" if self.use_cuda else "gloo")
        dtype = DTYPES[cfg.model.dtype]
        # AutoModel loads the causal LM's body and skips its LM head (the critic never needs the vocabulary).
        body = AutoModel.from_pretrained(self.model_path, dtype=dtype, attn_implementation="sdpa",
                                         trust_remote_code=cfg.model.trust_remote_code)
        model = ValueModel(body, body.config.hidden_size, c.head_init_std).to(dtype)
        head = Path(self.model_path) / HEAD_FILE
        if head.is_file():
            model.value_head.load_state_dict(torch.load(head, map_location="cpu"))
        if module_state is not None:  # before deepspeed.initialize, so its fp32 master partitions copy these
            model.load_state_dict(module_state)
        self.version = version
        self.pad_id = body.config.pad_token_id if body.config.pad_token_id is not None else 0
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=warmup_lr(c.lr, c.warmup_steps, 0),
                                           weight_decay=c.weight_decay)
        # As the policy's learner: the accumulation boundary set by train_step, the loss scaled by the global
        # token count (DeepSpeed never divides it).
        ds_config = deepspeed_config(1, c.max_grad_norm, c.zero_stage, cfg.model.dtype)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=ds_config)
        return self.rank

    def _batch(self, shard: TrainingBatch, idx: list[int]):
        """(padded model inputs, the micro-batch's TrainingBatch), both on the rank's device, for samples `idx`
        (an empty list: a masked padding micro-batch, so every rank runs the same number of collectives)."""
        return collate_micro_batch(shard, idx, False, self.pad_id, self._device())

    @torch.no_grad()
    def values(self, shard: TrainingBatch) -> tuple[torch.Tensor, int]:
        """((B, T) values of every response token, this critic's version). No collective: any rank answers alone."""
        module = self.engine.module
        module.eval()
        out = torch.zeros(shard.response_ids.shape, dtype=torch.float32)
        for idx in sample_count_micro_batches(shard.num_samples, self.cfg.critic.micro_batch_size):
            batch, part = self._batch(shard, idx)
            out[torch.tensor(idx), : part.width] = response_values(module, batch).float().cpu()
        return out, self.version

    def train_step(self, shard: TrainingBatch, num_tokens: float, num_micro_batches: int) -> dict[str, float]:
        """One critic update on this rank's shard of the batch (returns the targets, values the old values, on
        its loss tokens). num_tokens: loss tokens of the whole global batch (the normalizer); num_micro_batches:
        the count every rank runs (the driver's). Returns summed metrics (learner/value_loss.finalize_value_metrics)."""
        c = self.cfg.critic
        start = time.perf_counter()
        lr = warmup_lr(c.lr, c.warmup_steps, self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        plan = sample_count_micro_batches(shard.num_samples, c.micro_batch_size)
        if len(plan) > num_micro_batches:
            raise ValueError(f"critic rank {self.rank} needs {len(plan)} micro-batches but was told "
                             f"{num_micro_batches}: the driver's count must be the largest any rank needs")
        plan += [[] for _ in range(num_micro_batches - len(plan))]
        self.engine.set_train_batch_size(len(plan) * self.world_size)
        self.engine.train()
        summed: dict[str, float] = {}
        for k, idx in enumerate(plan):
            batch, part = self._batch(shard, idx)
            values = response_values(self.engine, batch)
            loss, metrics = clipped_value_loss(values, part.values, part.returns, part.loss_mask, c.value_clip,
                                               num_tokens)
            self.engine.set_gradient_accumulation_boundary(k == len(plan) - 1)
            # DeepSpeed averages gradients over ranks; the loss is this micro-batch's share of the global mean.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            self.engine.step()
            for key, value in metrics.items():
                summed[key] = summed.get(key, 0.0) + value
        self.version += 1
        grad_norm = self.engine.get_global_grad_norm()
        summed["critic/grad_norm_max"] = float(grad_norm) if grad_norm is not None else 0.0
        summed["critic/lr"] = lr
        summed["critic/version"] = float(self.version)
        summed["critic/seconds_max"] = time.perf_counter() - start
        return summed

    def save(self, folder: str) -> str | None:
        """Rank 0 writes the body as a Hugging Face model plus value_head.pt, loadable as critic.model_path."""
        if self.rank != 0:
            return None
        from transformers import AutoTokenizer

        module = self.engine.module
        module.body.save_pretrained(folder)
        torch.save(module.value_head.state_dict(), Path(folder) / HEAD_FILE)
        AutoTokenizer.from_pretrained(self.model_path).save_pretrained(folder)
        return folder

    def save_state(self, folder: str) -> int:
        """This rank's part of a DeepSpeed checkpoint (weights, optimizer partition) under `folder`/critic, for
        --resume. Collective: every rank calls it together. Returns the critic's version."""
        self.engine.save_checkpoint(folder, tag="critic", save_latest=False, client_state={"version": self.version})
        return self.version

    def load_state(self, folder: str) -> int:
        """Load what save_state wrote, the version included. Collective. Returns the version."""
        path, client = self.engine.load_checkpoint(folder, tag="critic", load_optimizer_states=True)
        if path is None:
            raise RuntimeError(f"critic rank {self.rank}: DeepSpeed found no checkpoint `critic` in {folder}")
        self.version = int(client["version"])
        return self.version

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = version

    def module_state(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, the value model's full weights on CPU). Under ZeRO-2 every rank holds every parameter, so
        one rank alone answers (no collective): a restarted group starts from a survivor's weights."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.engine.module.state_dict().items()}
        return self.version, state
