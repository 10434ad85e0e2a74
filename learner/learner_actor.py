"""One DeepSpeed data-parallel rank of the learner, hosted in a Ray actor.

The driver sends each rank its shard of the TrainingBatch (whole samples, advantages already computed on the
whole batch) with the shard's micro-batches from the one plan (learner/batch_plan.py), then the rank runs them
and takes one optimizer step; it reads which tokens train from the batch's `loss_mask`. A batch that makes
several steps (learner/update_plan.py) comes one mini-batch per call. This module holds the policy's forward and
loss of one micro-batch; the step around it (accumulation boundary, loss scale, non-finite skip), the warm-up
and the checkpoint are the rank template's (learner/rank_template.py), which the critic's ranks fill in too. Loss
values are shares of the mini-batch's loss (its global normalizers), scaled by the world size because DeepSpeed
averages gradients over ranks: the summed gradient is then the same for 1 or N ranks, whatever the split. Weights
leave through the transport that `weight_sync.type` names.

With learner.sequence_parallel_size = sp > 1, each group of sp consecutive ranks shares one shard: every
micro-batch is one packed row, each rank runs a 1/sp slice of it (Ulysses attention, learner/sequence_parallel.py)
and the loss scale is the number of groups (DeepSpeed sums gradients over the SP ranks and averages over groups).
"""

import time

import torch

from learner.batch import SampleBatch, score_responses, score_responses_at
from learner.batch_plan import MicroBatching, plan_one_shard
from learner.micro_batches import check_fits_context
from learner.objective import LossNormalizer, PolicyLossInputs, compute_policy_loss, needs_ref_logprobs
from learner.rank_setup import (
    DTYPES,
    attention_implementation,
    deepspeed_config,
    enable_gradient_checkpointing,
    micro_batches,
    peak_memory_gib,
    reset_peak_memory,
)
from learner.rank_template import StepReadings, TrainingRank
from learner.rank_weights import RankWeights
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


class LearnerRank(TrainingRank, RankWeights):
    """The policy's forward and loss in the rank template (learner/rank_template.py: the optimizer step's loop,
    the warm-up, the checkpoint); the weights going out (publish_weights, the weight group, save_hf) come from
    learner/rank_weights.py."""

    def __init__(self, cfg: RunConfig, rank: int, world_size: int, model_path: str) -> None:
        super().__init__(cfg, rank, world_size, model_path, cfg.learner.sequence_parallel_size)
        self.init_weights_out()
        self.micro_batching = MicroBatching.of_policy(cfg)
        self.groups = None  # SequenceParallelGroups when sp > 1

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
        self.lora = cfg.model.lora.enabled  # (also read by the checkpoint: learner/rank_checkpoint.py)
        if self.lora:
            # model.lora: peft freezes the base model and adds the adapter, the only parameters that train
            from peft import get_peft_model

            from weights.lora import peft_config

            model = get_peft_model(model, peft_config(cfg.model.lora, self.model_path))
        mpu = None
        if self.sp > 1:
            from learner.sequence_parallel_rank import enable_sequence_parallel

            self.groups, mpu = enable_sequence_parallel(model, self.sp)
        self.ref_model = None
        self.ref_is_base = self.lora and needs_ref_logprobs(cfg.algorithm) and cfg.reference.num_workers == 0
        """With LoRA the frozen initial policy is the base model (peft's adapter starts at zero): the reference is
        the same model with the adapter disabled (ref_logprobs, _policy_and_ref_scores), no second copy."""
        if needs_ref_logprobs(cfg.algorithm) and cfg.reference.num_workers == 0 and not self.lora:
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
        # with LoRA only the adapter trains: the optimizer (and its moments) hold the adapter alone
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=cfg.learner.lr, betas=cfg.learner.betas,
                                      weight_decay=cfg.learner.weight_decay, fused=fused or None)
        ds_config = deepspeed_config(self.num_micro, cfg.learner.max_grad_norm, cfg.learner.zero_stage,
                                     cfg.model.dtype)
        self._start_engine(deepspeed, model, optimizer, ds_config, cfg.learner.lr_warmup_steps, mpu=mpu,
                           decay_steps=cfg.learner.lr_decay_steps, min_ratio=cfg.learner.lr_min_ratio)
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
        plan = plan if plan is not None else plan_one_shard(shard, self.micro_batching)
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
        (reference.num_workers = 0; with LoRA, the base model under the disabled adapter). The driver asks once
        per step and puts them in the batch."""
        if self.ref_is_base:
            self.engine.eval()
            try:
                with self.engine.module.disable_adapter():
                    return self._score_shard(self.engine, shard, plan)
            finally:
                self.engine.train()
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
        start = time.perf_counter()
        dev = self._device()
        reset_peak_memory(dev)
        tokens = shard.sample_tokens()
        check_fits_context(tokens, getattr(self.hf_config, "max_position_embeddings", None))
        if shard.advantages is None:
            raise ValueError("LearnerRank.train_step needs a batch with advantages (learner/objective.py "
                             "compute_advantages); this one has none")
        self._check_ref(shard)
        plan = plan if plan is not None else plan_one_shard(shard, self.micro_batching)
        make = self._sequence_parallel_forward_and_loss if self.sp > 1 else self._forward_and_loss
        forward_and_loss = make(shard, normalizer, tokens)
        summed, readings = self._optimizer_step(plan, forward_and_loss,
                                                {"learner/real_tokens": 0.0, "learner/processed_tokens": 0.0})
        return self._finish_step(summed, start, len(plan), dev, readings)

    def _forward_and_loss(self, shard: TrainingBatch, normalizer: LossNormalizer, tokens: list[int]):
        """The policy's forward and loss of one micro-batch (the template's ForwardAndLoss), padded or packed
        rows (learner.packing), with the token counts of learner/real_tokens and learner/processed_tokens."""
        cfg = self.cfg

        def forward_and_loss(idx: list[int]):
            batch, part = self._collate(shard, idx)
            logprobs, entropy, ref, topk = self._policy_and_ref_scores(score_responses, batch, part.ref_logprobs,
                                                                       part.teacher_topk_ids)
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
                teacher_topk_logprobs=part.teacher_topk_logprobs,
                topk_logprobs=topk,
            )
            loss, metrics = compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)
            counts = {"learner/real_tokens": float(sum(tokens[i] for i in idx)),
                      "learner/processed_tokens": float(batch.processed_tokens)}
            return loss, logprobs, {**counts, **{key: float(value) for key, value in metrics.items()}}

        return forward_and_loss

    def _check_ref(self, shard: TrainingBatch) -> None:
        """A KL needs reference log-probs: from the batch, or from the rank's own reference model."""
        if (needs_ref_logprobs(self.cfg.algorithm) and self.ref_model is None and not self.ref_is_base
                and shard.ref_logprobs is None):
            raise ValueError(
                f"reference.num_workers={self.cfg.reference.num_workers} with algorithm.kl.beta="
                f"{self.cfg.algorithm.kl.beta}: the learner holds no reference model, so the batch must bring "
                "`ref_logprobs` (TrainingBatch.from_trajectories takes them from the trajectories); this one has none")

    def _policy_and_ref_scores(self, score, batch, ref: torch.Tensor | None, topk_ids: torch.Tensor | None = None):
        """(log-probs with grad, entropy (with grad only for an entropy bonus), reference log-probs or None, the
        policy's log-probs of `topk_ids` (B, T, k) with grad or None) of one micro-batch, `score` being the
        padded/packed scorer or the sequence-parallel one. `ref`: the batch's own reference log-probs (streamed, or
        scored once by the driver's request); the rank's reference model runs only when the batch has none and a
        KL needs them. `topk_ids`: the teacher's top-k (padded/packed layout only), scored in the same forward."""
        cfg = self.cfg
        topk = None
        if topk_ids is None:
            logprobs, entropy = score(self.engine, batch, cfg.rollout.temperature, cfg.learner.logits_chunk_tokens)
        else:
            logprobs, entropy, topk = score_responses_at(self.engine, batch, cfg.rollout.temperature,
                                                         cfg.learner.logits_chunk_tokens, topk_ids)
        if cfg.algorithm.entropy_coef <= 0:
            entropy = entropy.detach()
        if ref is None and self.ref_model is not None:
            with torch.no_grad():
                ref, _ = score(self.ref_model, batch, cfg.rollout.temperature, cfg.learner.logits_chunk_tokens)
        elif ref is None and self.ref_is_base:
            with torch.no_grad(), self.engine.module.disable_adapter():
                ref, _ = score(self.engine, batch, cfg.rollout.temperature, cfg.learner.logits_chunk_tokens)
        return logprobs, entropy, ref, topk

    def _finish_step(self, summed: dict[str, float], start: float, num_micro: int, dev: torch.device,
                     readings: StepReadings) -> dict[str, float]:
        """The step's rank-level readings, added to its summed metrics after the optimizer step."""
        summed["learner/skipped_nonfinite_max"] = float(self.skipped_nonfinite)
        summed["grad_norm_max"] = readings.grad_norm
        summed["learner_seconds_max"] = time.perf_counter() - start
        summed["learner/micro_batches_max"] = float(num_micro)
        summed["learner/peak_gib_max"] = peak_memory_gib(dev)
        # Optimizer steps this engine has taken in the run (several per batch with learner.ppo_epochs or
        # learner.mini_batches_per_step above 1): the count an LR schedule steps with.
        summed["learner/optimizer_steps_total_max"] = float(self.engine.global_steps)
        summed["learner/lr_max"] = readings.lr
        return summed

    def _sequence_parallel_forward_and_loss(self, shard: TrainingBatch, normalizer: LossNormalizer,
                                            tokens: list[int]):
        """_forward_and_loss when sp ranks share each sample: the same plan on every rank of
        the group, one packed row per micro-batch, this rank's 1/sp slice of it. Per-token metrics add up over the
        slices; what counts samples (num_sequences, learner/real_tokens) is counted by SP rank 0 only, so the
        group's sum counts each once."""
        cfg = self.cfg
        groups = self.groups
        dev = self._device()
        first = groups.sp_rank == 0
        per_token = tuple(name for name in ("behavior_logprobs", "advantages", "ref_logprobs", "proximal_logprobs")
                          if getattr(shard, name) is not None)

        def forward_and_loss(idx: list[int]):
            part = micro_batch(shard, idx)
            _, piece = self._sp_slice(shard, idx, per_token)
            # |y_i|: loss tokens of whole samples, as a slice may hold part of one (seq_mean_token_mean divides by it)
            lengths = part.loss_mask.sum(dim=1).float().to(dev)
            logprobs, entropy, ref, _ = self._policy_and_ref_scores(sequence_parallel_scores, piece,
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
            counts = {"learner/real_tokens": float(sum(tokens[i] for i in idx)) if first else 0.0,
                      "learner/processed_tokens": float(piece.input_ids.numel())}
            return loss, logprobs, {**counts, **{key: float(value) for key, value in metrics.items()}}

        return forward_and_loss

    def ping(self) -> int:
        return self.rank
