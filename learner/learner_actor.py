"""One DeepSpeed data-parallel rank of the learner, hosted in a Ray actor.

The driver sends each rank its shard of the TrainingBatch (whole samples, advantages already computed on the
whole batch) with the shard's micro-batches from the one plan (learner/batch_plan.py), then the rank runs them
and takes one optimizer step; it reads which tokens train from the batch's `loss_mask`. A batch that makes
several steps (learner/update_plan.py) comes one mini-batch per call. Loss values are shares of the
mini-batch's loss (its global normalizers), scaled by the world size because DeepSpeed averages gradients over
ranks: the summed gradient is then the same for 1 or N ranks, whatever the split. Weights leave through the
transport that `weight_sync.type` names.

With learner.sequence_parallel_size = sp > 1, each group of sp consecutive ranks shares one shard: every
micro-batch is one packed row, each rank runs a 1/sp slice of it (Ulysses attention, learner/sequence_parallel.py)
and the loss scale is the number of groups (DeepSpeed sums gradients over the SP ranks and averages over groups).
"""

import time

import torch

from learner.batch import SampleBatch, score_responses
from learner.batch_plan import plan_one_shard
from learner.lr_schedule import warmup_schedule
from learner.micro_batches import check_fits_context
from learner.nonfinite import agree, check_skipped, is_nonfinite, poison
from learner.objective import (
    LossNormalizer,
    PolicyLossInputs,
    combine_metrics,
    compute_policy_loss,
    needs_ref_logprobs,
)
from learner.rank_checkpoint import RankCheckpoint
from learner.rank_weights import RankWeights
from learner.rank_setup import (
    DTYPES,
    DeepSpeedRank,
    attention_implementation,
    deepspeed_config,
    enable_gradient_checkpointing,
    micro_batches,
    peak_memory_gib,
    reset_peak_memory,
)
from learner.shard_scoring import collate_micro_batch, micro_batch, score_shard
from learner.sequence_parallel import (
    gather_sequence,
    pack_row,
    per_sample_to_columns,
    response_values,
    sequence_mean_over_group,
    sequence_parallel_scores,
    shard_row,
)
from learner.startup_heap import frozen_after_imports
from protocols.config import RunConfig
from protocols.training_batch import TrainingBatch


class LearnerRank(DeepSpeedRank, RankCheckpoint, RankWeights):
    """The checkpoint and state methods (save_state, load_state, optimizer_digest, state_snapshot) come from
    learner/rank_checkpoint.py; the weights going out (publish_weights, the weight group, save_hf) from
    learner/rank_weights.py."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str) -> None:
        super().__init__(cfg, rank, world_size, model_path)
        self.init_weights_out()
        self.sp = cfg.learner.sequence_parallel_size
        self.groups = None  # SequenceParallelGroups when sp > 1
        self.skipped_nonfinite = 0
        """Updates skipped because the loss or the gradient norm was NaN or infinite (learner/nonfinite.py)."""

    def setup(self, master_addr: str, master_port: int) -> int:
        """Join the process group and build the DeepSpeed engine. All ranks must call it together."""
        with frozen_after_imports():
            import deepspeed
            from transformers import AutoModelForCausalLM

        cfg = self.cfg
        backend = cfg.learner.backend if cfg.learner.backend != "auto" else ("nccl" if self.use_cuda else "gloo")
        self._join_process_group(deepspeed, master_addr, master_port, backend)
        dtype = DTYPES[cfg.model.dtype]
        attn = attention_implementation(self.use_cuda, cfg.learner.packing or self.sp > 1, dtype)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype, attn_implementation=attn,
                                                     trust_remote_code=cfg.model.trust_remote_code)
        if cfg.learner.gradient_checkpointing:
            enable_gradient_checkpointing(model, cfg.learner.uncheckpointed_layers,
                                          cfg.learner.checkpoint_keeps_attention)
        mpu = None
        if self.sp > 1:
            from learner.sequence_parallel_rank import enable_sequence_parallel

            self.groups, mpu = enable_sequence_parallel(model, self.sp)
        self.ref_model = None
        if needs_ref_logprobs(cfg.algorithm) and cfg.reference.num_workers == 0:
            # Frozen initial policy for the KL term. With reference.num_workers > 0 the reference workers send
            # its log-probs with every trajectory instead, and the rank holds no second copy of the model.
            self.ref_model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype,
                                                                  attn_implementation=attn).eval()
            self.ref_model.requires_grad_(False)
            if self.sp > 1:
                from learner.sequence_parallel_rank import enable_sequence_parallel

                enable_sequence_parallel(self.ref_model, self.sp, groups=self.groups)
            # DeepSpeed moves the policy to the rank's device; the frozen copy must follow it, or the first
            # KL-in-the-loss step fails on a GPU with tensors on two devices.
            if self.use_cuda:
                self.ref_model.to(torch.device("cuda", torch.cuda.current_device()))
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.hf_config = model.config
        # Samples per data-parallel group (the SP ranks of a group share theirs); only DeepSpeed's initial batch
        # bookkeeping reads it, train_step sets the real count every step.
        per_rank = -(-cfg.samples_per_step // (self.world_size // self.sp))
        self.num_micro = len(micro_batches(per_rank, cfg.learner.micro_batch_size))
        fused = cfg.learner.fused_adamw and self.use_cuda  # the fp32 master copies DeepSpeed steps live on the GPU
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr, betas=cfg.learner.betas,
                                      weight_decay=cfg.learner.weight_decay, fused=fused or None)
        ds_config = deepspeed_config(self.num_micro, cfg.learner.max_grad_norm, cfg.learner.zero_stage,
                                     cfg.model.dtype)
        # DeepSpeed steps the schedule at every accumulation boundary, i.e. once per optimizer step.
        schedule = warmup_schedule(optimizer, cfg.learner.lr_warmup_steps) if cfg.learner.lr_warmup_steps else None
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule,
                                               config=ds_config, mpu=mpu)
        return self.num_micro

    # --- scoring ---------------------------------------------------------------------------------------------
    def _collate(self, shard: TrainingBatch, idx: list[int]) -> tuple[SampleBatch, TrainingBatch]:
        """(model inputs, the micro-batch's TrainingBatch), both on the rank's device, for samples `idx` of the
        shard (learner/shard_scoring.py: an empty list is a masked padding micro-batch)."""
        return collate_micro_batch(shard, idx, self.cfg.learner.packing, self.pad_id, self._device())

    def _sp_slice(self, shard: TrainingBatch, idx: list[int], per_token: tuple[str, ...] = ()):
        """(the whole packed row, this rank's slice of it on the device) for samples `idx` of the shard (an empty
        list: a masked padding micro-batch, as in _collate)."""
        row = pack_row(micro_batch(shard, idx), self.pad_id, per_token, multiple_of=self.sp)
        piece = shard_row(row, self.groups.sp_rank, self.sp)
        dev = self._device()
        for name in ("input_ids", "position_ids", "target_ids", "loss_mask", "score_mask", "sample_index"):
            setattr(piece, name, getattr(piece, name).to(dev))
        piece.per_token = {name: value.to(dev) for name, value in piece.per_token.items()}
        return row, piece

    @torch.no_grad()
    def _score_shard(self, model, shard: TrainingBatch, plan: list[list[int]],
                     temperature: float | None = None) -> torch.Tensor:
        """(B, T) log-probs of the shard's loss tokens under `model` (0 elsewhere), in the micro-batches `plan`
        (None: this rank's own plan, for a rank that runs alone), at `temperature` (None: rollout.temperature)."""
        plan = plan if plan is not None else plan_one_shard(shard, self.cfg)
        temperature = self.cfg.rollout.temperature if temperature is None else temperature
        if self.sp == 1:
            lcfg = self.cfg.learner
            return score_shard(model, shard, plan, temperature, lcfg.logits_chunk_tokens,
                               lcfg.packing, self.pad_id, self._device())
        out = torch.zeros(shard.loss_mask.shape, dtype=torch.float32)
        for idx in plan:
            row, piece = self._sp_slice(shard, idx)
            lps, _ = sequence_parallel_scores(model, piece, temperature, self.cfg.learner.logits_chunk_tokens)
            whole = gather_sequence(lps, self.groups.sp_group).cpu()
            if idx:
                values = response_values(whole, row, shard.width)
                out[torch.tensor(idx)] = values
        return out

    def ref_logprobs(self, shard: TrainingBatch, plan: list[list[int]] | None = None) -> torch.Tensor:
        """(B, T) reference-policy log-probs of the shard's loss tokens, when the rank holds the reference model
        (reference.num_workers = 0). The driver asks once per step and puts them in the batch."""
        if self.ref_model is None:
            raise RuntimeError(
                f"this learner rank holds no reference model (reference.num_workers={self.cfg.reference.num_workers}, "
                f"algorithm.kl.beta={self.cfg.algorithm.kl.beta}): with reference workers the reference log-probs "
                "come with the trajectories (Trajectory.ref_logprobs)")
        return self._score_shard(self.ref_model, shard, plan)

    def policy_logprobs(self, shard: TrainingBatch, plan: list[list[int]] | None = None) -> torch.Tensor:
        """(B, T) current-policy log-probs of the shard's loss tokens (weight-sync checks, proximal recompute).
        Under ZeRO-3 each forward is a collective: every rank gets a plan of the same length."""
        self.engine.eval()
        try:
            return self._score_shard(self.engine, shard, plan)
        finally:
            self.engine.train()

    def probe_logprobs(self, shard: TrainingBatch, plan: list[list[int]] | None = None) -> torch.Tensor:
        """(B, T) current-policy log-probs at temperature 1, whatever rollout.temperature: what the engine's prompt
        log-probs are (raw logits), for the weight-sync check's probe (weights/sync_check.py)."""
        self.engine.eval()
        try:
            return self._score_shard(self.engine, shard, plan, temperature=1.0)
        finally:
            self.engine.train()

    # --- the update ----------------------------------------------------------------------------------------------
    def train_step(self, shard: TrainingBatch, normalizer: LossNormalizer,
                   plan: list[list[int]] | None = None) -> dict[str, float]:
        """One optimizer step on this rank's shard of the batch (advantages set; ref_logprobs set when a KL needs
        them and the rank holds no reference model; proximal_logprobs set when the driver scored them before the
        batch's first update), in the micro-batches of `plan` (the driver's, the same count on every rank; None:
        this rank's own plan, for a rank that runs alone).
        Returns summed metrics (see finalize_metrics), plus learner/real_tokens and learner/processed_tokens
        (padding included), learner/micro_batches_max and learner/peak_gib_max."""
        cfg = self.cfg
        start = time.perf_counter()
        dev = self._device()
        reset_peak_memory(dev)
        tokens = shard.sample_tokens()
        check_fits_context(tokens, getattr(self.hf_config, "max_position_embeddings", None))
        if shard.advantages is None:
            raise ValueError("LearnerRank.train_step needs a batch with advantages (learner/objective.py "
                             "compute_advantages); this one has none")
        self._check_ref(shard)
        plan = plan if plan is not None else plan_one_shard(shard, cfg)
        if self.sp > 1:
            return self._train_step_sequence_parallel(shard, normalizer, plan, tokens, start)
        # The engine's batch size follows this step's count (DeepSpeed's own bookkeeping); the boundary is set
        # explicitly below, so a count that changes between steps never meets a stale micro-step counter.
        self.engine.set_train_batch_size(len(plan) * self.world_size)
        summed: dict[str, float] = {"learner/real_tokens": 0.0, "learner/processed_tokens": 0.0}
        lr = self.engine.get_lr()[0]  # this step's: the schedule moves on at the step's boundary
        self.engine.train()
        nonfinite = False
        for k, idx in enumerate(plan):
            batch, part = self._collate(shard, idx)
            logprobs, entropy, ref = self._policy_and_ref_scores(score_responses, batch, part.ref_logprobs)
            inputs = PolicyLossInputs(
                behavior_logprobs=part.behavior_logprobs,
                advantages=part.advantages,
                loss_mask=part.loss_mask,
                # Several updates per batch: the driver scored them before the first (part.proximal_logprobs).
                # One: the policy before the update is the one computing `logprobs`, so the proximal log-probs of
                # decoupled PPO come free, without a second forward pass.
                proximal_logprobs=(part.proximal_logprobs if part.proximal_logprobs is not None
                                   else logprobs.detach()),
                ref_logprobs=ref,
                entropy=entropy,
            )
            loss, metrics = compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)
            loss, nonfinite = self._guard_nonfinite(loss, logprobs, nonfinite, k == len(plan) - 1, dev)
            self.engine.set_gradient_accumulation_boundary(k == len(plan) - 1)
            # DeepSpeed averages gradients over ranks; the loss is this micro-batch's share of the global sum.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            self.engine.step()
            summed["learner/real_tokens"] += float(sum(tokens[i] for i in idx))
            summed["learner/processed_tokens"] += float(batch.processed_tokens)
            summed = combine_metrics([summed, {key: float(value) for key, value in metrics.items()}])
            del logprobs, entropy, inputs, loss, batch, part
        return self._finish_step(summed, start, len(plan), dev, lr, nonfinite)

    def _check_ref(self, shard: TrainingBatch) -> None:
        """A KL needs reference log-probs: from the batch, or from the rank's own reference model."""
        if needs_ref_logprobs(self.cfg.algorithm) and self.ref_model is None and shard.ref_logprobs is None:
            raise ValueError(
                f"reference.num_workers={self.cfg.reference.num_workers} with algorithm.kl.beta="
                f"{self.cfg.algorithm.kl.beta}: the learner holds no reference model, so the batch must bring "
                "`ref_logprobs` (TrainingBatch.from_trajectories takes them from the trajectories); this one has none")

    def _policy_and_ref_scores(self, score, batch, ref: torch.Tensor | None):
        """(log-probs with grad, entropy (with grad only for an entropy bonus), reference log-probs or None) of one
        micro-batch, `score` being the padded/packed scorer or the sequence-parallel one. `ref`: the batch's own
        reference log-probs (streamed, or scored once by the driver's request); the rank's reference model runs
        only when the batch has none and a KL needs them."""
        cfg = self.cfg
        logprobs, entropy = score(self.engine, batch, cfg.rollout.temperature, cfg.learner.logits_chunk_tokens)
        if cfg.algorithm.entropy_coef <= 0:
            entropy = entropy.detach()
        if ref is None and self.ref_model is not None:
            with torch.no_grad():
                ref, _ = score(self.ref_model, batch, cfg.rollout.temperature, cfg.learner.logits_chunk_tokens)
        return logprobs, entropy, ref

    def _guard_nonfinite(self, loss: torch.Tensor, logprobs: torch.Tensor, nonfinite: bool, last: bool,
                         dev: torch.device) -> tuple[torch.Tensor, bool]:
        """(the loss to backward, whether the step so far saw a non-finite loss). Before the step's last backward
        every rank agrees (all-reduce) and, if any saw one, makes its gradient non-finite so the optimizer's
        global norm check skips the update on every rank (learner/nonfinite.py)."""
        nonfinite = nonfinite or is_nonfinite(loss)
        if last:
            nonfinite = agree(nonfinite, dev)
            if nonfinite:
                loss = poison(loss, logprobs)
        return loss, nonfinite

    def _finish_step(self, summed: dict[str, float], start: float, num_micro: int,
                     dev: torch.device, lr: float, nonfinite: bool = False) -> dict[str, float]:
        """The step's rank-level readings, added to its summed metrics after the optimizer step; `lr` is the
        learning rate the step used."""
        grad_norm = self.engine.get_global_grad_norm()
        # A NaN/inf loss or gradient norm: the optimizer dropped the step (weights and moments unchanged).
        self.skipped_nonfinite += check_skipped(nonfinite, grad_norm)
        summed["learner/skipped_nonfinite_max"] = float(self.skipped_nonfinite)
        summed["grad_norm_max"] = float(grad_norm) if grad_norm is not None else 0.0
        summed["learner_seconds_max"] = time.perf_counter() - start
        summed["learner/micro_batches_max"] = float(num_micro)
        summed["learner/peak_gib_max"] = peak_memory_gib(dev)
        # Optimizer steps this engine has taken in the run (several per batch with learner.ppo_epochs or
        # learner.mini_batches_per_step above 1): the count an LR schedule steps with.
        summed["learner/optimizer_steps_total_max"] = float(self.engine.global_steps)
        summed["learner/lr_max"] = float(lr)
        return summed

    def _train_step_sequence_parallel(self, shard: TrainingBatch, normalizer: LossNormalizer,
                                      plan: list[list[int]], tokens: list[int], start: float) -> dict[str, float]:
        """train_step when sp ranks share each sample: the same plan on every rank of the group, one packed row per
        micro-batch, this rank's 1/sp slice of it. Per-token metrics add up over the slices; what counts samples
        (num_sequences, learner/real_tokens) is counted by SP rank 0 only, so the group's sum counts each once."""
        cfg = self.cfg
        groups = self.groups
        dev = self._device()
        first = groups.sp_rank == 0
        # What set_train_batch_size writes, counting data-parallel groups, not ranks. DeepSpeed 0.19's own call
        # fails under a Ulysses mpu (its engine.dp_world_size is None there); the boundary is set explicitly below.
        self.engine._config.train_batch_size = len(plan) * groups.dp_size
        self.engine._config.gradient_accumulation_steps = len(plan)
        summed: dict[str, float] = {"learner/real_tokens": 0.0, "learner/processed_tokens": 0.0}
        lr = self.engine.get_lr()[0]  # this step's: the schedule moves on at the step's boundary
        self.engine.train()
        per_token = tuple(name for name in ("behavior_logprobs", "advantages", "ref_logprobs", "proximal_logprobs")
                          if getattr(shard, name) is not None)
        nonfinite = False
        for k, idx in enumerate(plan):
            part = micro_batch(shard, idx)
            row, piece = self._sp_slice(shard, idx, per_token)
            # |y_i|: loss tokens of whole samples, as a slice may hold part of one (seq_mean_token_mean divides by it)
            lengths = part.loss_mask.sum(dim=1).float().to(dev)
            logprobs, entropy, ref = self._policy_and_ref_scores(sequence_parallel_scores, piece,
                                                                 piece.per_token.get("ref_logprobs"))
            inputs = PolicyLossInputs(
                behavior_logprobs=piece.per_token["behavior_logprobs"],
                advantages=piece.per_token["advantages"],
                loss_mask=piece.loss_mask,
                proximal_logprobs=piece.per_token.get("proximal_logprobs", logprobs.detach()),
                ref_logprobs=ref,
                entropy=entropy,
                sequence_lengths=per_sample_to_columns(piece, lengths),
                sequence_mean=sequence_mean_over_group(piece, lengths, groups.sp_group),
            )
            loss, metrics = compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)
            # A packed row is one "sequence" to compute_policy_loss; count samples with a loss token instead.
            metrics["num_sequences"] = float((lengths > 0).sum()) if first else 0.0
            loss, nonfinite = self._guard_nonfinite(loss, logprobs, nonfinite, k == len(plan) - 1, dev)
            self.engine.set_gradient_accumulation_boundary(k == len(plan) - 1)
            # DeepSpeed sums gradients over the SP ranks and divides by the dp size: scale the share by dp.
            self.engine.backward(loss * groups.dp_size, scale_wrt_gas=False)
            self.engine.step()
            if first:
                summed["learner/real_tokens"] += float(sum(tokens[i] for i in idx))
            summed["learner/processed_tokens"] += float(piece.input_ids.numel())
            summed = combine_metrics([summed, {key: float(value) for key, value in metrics.items()}])
            del logprobs, entropy, inputs, loss, piece, row, part
        return self._finish_step(summed, start, len(plan), dev, lr, nonfinite)

    def ping(self) -> int:
        return self.rank
