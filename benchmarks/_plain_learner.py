"""The plain-torch learners of benchmarks/learner_gpu.py (variants `plain` and `chunked`): the same
micro-batches, scoring and policy loss as `LearnerRank.train_step`, with fp32 master weights and torch AdamW but
no DeepSpeed, so the DeepSpeed variant's time over theirs is DeepSpeed's overhead.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks._gpu_common import Phases, Result, free_memory, peak_gib, reset_peak, sync


def _chunked_scores(model, batch, temperature: float, chunk_tokens: int):
    """(B, T) log-probs with grad and entropy without grad, never holding (B, T, V) logits."""
    from torch.utils.checkpoint import checkpoint

    # Same rows as learner.batch.response_logits: responses start at one column P (left-padded prompts), and
    # response token j is predicted by the output at P + j - 1, i.e. the last T + 1 positions minus the final one.
    width_t = batch.score_mask.size(1)
    hidden = model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=batch.position_ids).last_hidden_state
    h = hidden[:, -(width_t + 1):-1]
    b, t, d = h.shape
    h = h.reshape(b * t, d)
    ids = batch.response_ids.reshape(b * t)
    head = model.lm_head

    def chunk_fn(hc, idc):
        z = head(hc).float() / temperature
        lse = torch.logsumexp(z, dim=-1)
        lp = torch.gather(z, -1, idc.unsqueeze(-1)).squeeze(-1) - lse
        with torch.no_grad():
            ent = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        return lp, ent

    lps, ents = [], []
    for s in range(0, b * t, chunk_tokens):
        lp, ent = checkpoint(chunk_fn, h[s:s + chunk_tokens], ids[s:s + chunk_tokens], use_reentrant=False)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps).view(b, t), torch.cat(ents).view(b, t)


def run_plain(cfg, folder: Path, shard, normalizer, warmup: int, steps: int, res: Result,
              chunked: bool, chunk_tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    from learner.batch import collate, response_logits, token_logprobs
    from learner.batch_plan import MicroBatching, plan_one_shard
    from learner.objective import PolicyLossInputs, compute_policy_loss, entropy_from_logits
    from learner.rank_setup import DTYPES

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPES[cfg.model.dtype]).to(dev)
    if cfg.learner.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    for m in masters:
        m.grad = torch.zeros_like(m)
    lc = cfg.learner
    opt = torch.optim.AdamW(masters, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
    sync()
    res.setup_s = time.perf_counter() - t0
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    temp = cfg.rollout.temperature
    plan = plan_one_shard(shard, MicroBatching.of_policy(cfg))
    ph = Phases()

    def step(instrument: bool) -> float:
        total_loss = 0.0
        for idx in plan:
            t = time.perf_counter()
            part = shard.select(idx)
            batch = collate(part, pad_id)
            for name, value in vars(batch).items():  # every tensor field, as LearnerRank._collate moves them
                if torch.is_tensor(value):
                    setattr(batch, name, value.to(dev))
            part = part.to(dev)
            if chunked:
                logprobs, entropy = _chunked_scores(model, batch, temp, chunk_tokens)
            else:
                logits = response_logits(model, batch, temp)
                logprobs = token_logprobs(logits, batch.response_ids)
                with torch.no_grad():
                    entropy = entropy_from_logits(logits.detach())
            inputs = PolicyLossInputs(
                behavior_logprobs=part.behavior_logprobs, advantages=part.advantages, loss_mask=part.loss_mask,
                proximal_logprobs=logprobs.detach(), ref_logprobs=None, entropy=entropy)
            loss, metrics = compute_policy_loss(logprobs, inputs, cfg.algorithm, normalizer)
            total_loss += metrics["loss"]
            if instrument:
                sync()
                t1 = time.perf_counter()
                ph.fwd += t1 - t
            loss.backward()
            for m, p in zip(masters, params):
                m.grad.add_(p.grad)
                p.grad = None
            if instrument:
                sync()
                ph.bwd += time.perf_counter() - t1
            if not chunked:
                del logits
            del logprobs, entropy, inputs, loss, batch, part
        t = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(masters, lc.max_grad_norm)
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
                m.grad.zero_()
        if instrument:
            sync()
            ph.opt += time.perf_counter() - t
        return total_loss

    for i in range(warmup):
        loss0 = step(False)
        if i == 0:
            res.first_loss = loss0
    sync()
    reset_peak()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(False)
    sync()
    res.s_per_step = (time.perf_counter() - t0) / steps
    res.peak_gib = peak_gib()
    step(True)
    res.phases = asdict(ph)
    del model, params, masters, opt
    free_memory()
