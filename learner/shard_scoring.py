"""Scoring a shard of samples without grad: per-token log-probs of each response under a model.

One code path for the learner rank (reference and current-policy scoring, learner/learner_actor.py) and the
reference workers (actors/reference_worker.py): the same micro-batch plan, padded or packed layout, chunked LM
head and sampling temperature, so a reference worker's log-probs are the learner's own numbers. Pure torch.
"""

import torch

from learner.batch import SampleBatch, collate, collate_packed, score_responses
from learner.rank_setup import plan_micro_batches
from protocols.config import RunConfig


def collate_micro_batch(shard: dict, idx: list[int], packing: bool, pad_id: int,
                        device: torch.device) -> tuple[SampleBatch, list[int]]:
    """(micro-batch tensors on `device`, the sample indices it holds) for samples `idx` of `shard`. An empty
    list (a padding micro-batch) gets the shard's shortest sample, which the caller masks out, so the
    forward/backward still runs and every rank's collectives line up."""
    rows = idx or [min(range(len(shard["prompt_ids"])), key=lambda i: len(shard["prompt_ids"][i])
                       + len(shard["response_ids"][i]))]
    make = collate_packed if packing else collate
    batch = make([shard["prompt_ids"][i] for i in rows], [shard["response_ids"][i] for i in rows], pad_id)
    for name, value in vars(batch).items():
        if torch.is_tensor(value):
            setattr(batch, name, value.to(device))
    return batch, rows


@torch.no_grad()
def score_shard(model: torch.nn.Module, shard: dict, cfg: RunConfig, count: int | None, pad_id: int,
                device: torch.device, plan: list[list[int]] | None = None) -> list[list[float]]:
    """log p(response token) under `model` for every sample of `shard` (per-sample lists `prompt_ids`,
    `response_ids`), at rollout.temperature, in the micro-batches learner.micro_batch_size or
    learner.max_tokens_per_micro_batch plan (exactly `count` of them when given: under ZeRO-3 every rank must
    run the same number of forwards), through the chunked head (learner.logits_chunk_tokens). `plan`: that
    plan when the caller already made it."""
    out: list[list[float] | None] = [None] * len(shard["prompt_ids"])
    for idx in plan if plan is not None else plan_micro_batches(shard, cfg, count):
        batch, _ = collate_micro_batch(shard, idx, cfg.learner.packing, pad_id, device)
        lps, _ = score_responses(model, batch, cfg.rollout.temperature, cfg.learner.logits_chunk_tokens)
        for row, i in zip(lps.cpu(), idx):
            out[i] = row[: len(shard["response_ids"][i])].tolist()
    return out
