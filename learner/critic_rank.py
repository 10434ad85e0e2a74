"""One DeepSpeed rank of the critic (PPO's value model), hosted by a Ray actor (actors/critic_worker.py).

The ranks train together in the rank template the policy's learner ranks use (learner/rank_template.py): ZeRO-2
data parallelism on gloo (CPU) or NCCL (GPUs), their own AdamW, learning rate and linear warm-up
(learner/lr_schedule.py), the driver's plan of shards and micro-batches (learner/batch_plan.py), a global token
normalizer so the gradient is the same for 1 or N ranks, and checkpoints with the RNG states. This module adds the
value model and the clipped value loss of one micro-batch (learner/value_loss.py). Between updates each rank alone
computes values for trajectories in the stream (ZeRO-2 keeps the full parameters on every rank, so a forward needs
no collective).
"""

import time
from pathlib import Path

import torch

from learner.batch_plan import MicroBatching, plan_one_shard
from learner.rank_setup import DTYPES, deepspeed_config
from learner.rank_template import TrainingRank
from learner.shard_scoring import collate_micro_batch
from learner.startup_heap import frozen_after_imports
from learner.value_loss import clipped_value_loss
from learner.value_model import ValueModel, response_values
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch

HEAD_FILE = "value_head.pt"
"""The value head's state dict inside a saved critic folder (the body is a Hugging Face model beside it)."""


class CriticRank(TrainingRank):
    role = "critic"

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str) -> None:
        """model_path: the critic's folder (critic.model_path, or the policy's when that is empty)."""
        super().__init__(cfg, rank, world_size, model_path)
        self.micro_batching = MicroBatching.of_critic(cfg)
        self.version = 0
        """The critic's version as the group last told it (cluster/critic_group.py counts the updates; this rank
        only holds the number): stamped on the values it computes and saved in its checkpoints."""

    def setup(self, master_addr: str, master_port: int, module_state: dict | None = None, version: int = 0) -> int:
        """Join the critic's process group and build its DeepSpeed engine. Every rank must call it together.
        module_state: full weights (`module_state()` of a rank of an earlier group) to start from instead of
        model_path's; version: the update count to continue from (a restarted group keeps its version, and its
        warm-up goes on from there)."""
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        # train_step sets the micro-batch count of every step, so the config's count (1) is only DeepSpeed's start.
        ds_config = deepspeed_config(1, c.max_grad_norm, c.zero_stage, cfg.model.dtype)
        self._start_engine(deepspeed, model, optimizer, ds_config, c.warmup_steps, completed_steps=version)
        return self.rank

    def _batch(self, shard: TrainingBatch, idx: list[int]):
        """(padded model inputs, the micro-batch's TrainingBatch), both on the rank's device, for samples `idx`
        (an empty list: a masked padding micro-batch, so every rank runs the same number of collectives)."""
        return collate_micro_batch(shard, idx, False, self.pad_id, self._device())

    @torch.no_grad()
    def values(self, shard: TrainingBatch, plan: list[list[int]] | None = None) -> tuple[torch.Tensor, int]:
        """((B, T) values of every response token, this critic's version), in the micro-batches of `plan` (the
        driver's; None: this rank's own plan, for a rank called alone). No collective: any rank answers alone,
        so it skips the plan's padding micro-batches."""
        module = self.engine.module
        module.eval()
        out = torch.zeros(shard.response_ids.shape, dtype=torch.float32)
        for idx in plan if plan is not None else plan_one_shard(shard, self.micro_batching):
            if idx:
                batch, part = self._batch(shard, idx)
                out[torch.tensor(idx), : part.width] = response_values(module, batch).float().cpu()
        return out, self.version

    def train_step(self, shard: TrainingBatch, num_tokens: float, version: int,
                   plan: list[list[int]] | None = None) -> dict[str, float]:
        """One critic update on this rank's shard of the batch (returns the targets, values the old values, on
        its loss tokens), in the micro-batches of `plan` (the driver's, the same count on every rank; None: this
        rank's own plan, for a rank that runs alone). num_tokens: loss tokens of the whole global batch (the
        normalizer); version: the group's update count with this update taken, stamped from now on. Returns
        summed metrics (learner/value_loss.finalize_value_metrics)."""
        c = self.cfg.critic
        start = time.perf_counter()
        plan = plan if plan is not None else plan_one_shard(shard, self.micro_batching)

        def forward_and_loss(idx: list[int]):
            batch, part = self._batch(shard, idx)
            values = response_values(self.engine, batch)
            loss, metrics = clipped_value_loss(values, part.values, part.returns, part.loss_mask, c.value_clip,
                                               num_tokens)
            return loss, values, metrics

        summed, readings = self._optimizer_step(plan, forward_and_loss)
        self.version = version
        summed["critic/grad_norm_max"] = readings.grad_norm
        summed["critic/lr"] = readings.lr
        summed["critic/version"] = float(self.version)
        summed["critic/skipped_nonfinite_max"] = float(self.skipped_nonfinite)
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

    def client_state(self) -> dict:
        """The version goes into the critic's DeepSpeed checkpoint (save_state, load_state: the rank template's)."""
        return {"version": self.version}

    def restore_client_state(self, state: dict) -> None:
        self.version = int(state["version"])

    def set_version(self, version: int) -> None:
        """The group's version after a restart (updates lost with a dead rank count too); the warm-up follows."""
        self.version = version
        self._seek_schedule(version)

    def module_state(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, the value model's full weights on CPU). Under ZeRO-2 every rank holds every parameter, so
        one rank alone answers (no collective): a restarted group starts from a survivor's weights."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.engine.module.state_dict().items()}
        return self.version, state
