"""Micro-batches of a shard, and scoring a shard without grad: per-token log-probs of each response under a model.

One code path for the learner rank (reference and current-policy scoring, learner/learner_actor.py) and the
reference workers (actors/reference_worker.py): the same micro-batch plan, padded or packed layout, chunked LM
head and sampling temperature, so a reference worker's log-probs are the learner's own numbers. Pure torch.
"""

import torch

from learner.batch import SampleBatch, collate, collate_packed, score_responses, score_responses_topk
from protocols.training_batch import TrainingBatch


def micro_batch(shard: TrainingBatch, idx: list[int]) -> TrainingBatch:
    """Samples `idx` of `shard`. An empty list (a padding micro-batch) gets the shard's shortest sample with
    nothing to train on, so the forward/backward still runs and every rank's collectives line up."""
    if idx:
        return shard.select(idx)
    tokens = shard.sample_tokens()
    return shard.select([min(range(len(tokens)), key=tokens.__getitem__)]).masked()


def collate_micro_batch(shard: TrainingBatch, idx: list[int], packing: bool, pad_id: int,
                        device: torch.device) -> tuple[SampleBatch, TrainingBatch]:
    """(model inputs on `device`, the micro-batch's own TrainingBatch on `device`) for samples `idx` of `shard`,
    in the padded or packed layout (learner.packing)."""
    part = micro_batch(shard, idx)
    batch = (collate_packed if packing else collate)(part, pad_id)
    for name, value in vars(batch).items():
        if torch.is_tensor(value):
            setattr(batch, name, value.to(device))
    return batch, part.to(device)


@torch.no_grad()
def score_shard(model: torch.nn.Module, shard: TrainingBatch, plan: list[list[int]], temperature: float,
                chunk_tokens: int, packing: bool, pad_id: int, device: torch.device) -> torch.Tensor:
    """(B, T) log p(token) under `model` of the tokens `shard.loss_mask` marks (0 elsewhere), at the sampling
    `temperature`, in the micro-batches of `plan` (indices into the shard), through the chunked head
    (learner.logits_chunk_tokens). Under ZeRO-3 each forward is a collective: every rank must run a plan of
    the same length."""
    out = torch.zeros(shard.loss_mask.shape, dtype=torch.float32)
    for idx in plan:
        batch, part = collate_micro_batch(shard, idx, packing, pad_id, device)
        lps, _ = score_responses(model, batch, temperature, chunk_tokens)
        if idx:
            out[torch.tensor(idx), : part.width] = lps.cpu()
    return out


@torch.no_grad()
def score_shard_topk(model: torch.nn.Module, shard: TrainingBatch, plan: list[list[int]], temperature: float,
                     chunk_tokens: int, packing: bool, pad_id: int, device: torch.device,
                     k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """score_shard, plus the model's k most likely ids and their log-probs at every response position:
    (logprobs (B, T), topk_ids (B, T, k) long, topk_logprobs (B, T, k)), 0 past each response's end. A teacher
    worker's scores for top-k distillation (algorithm.distillation.top_k)."""
    b, t = shard.loss_mask.shape
    out = torch.zeros((b, t), dtype=torch.float32)
    ids = torch.zeros((b, t, k), dtype=torch.long)
    top = torch.zeros((b, t, k), dtype=torch.float32)
    for idx in plan:
        batch, part = collate_micro_batch(shard, idx, packing, pad_id, device)
        lps, part_ids, part_top = score_responses_topk(model, batch, temperature, chunk_tokens, k)
        if idx:
            rows = torch.tensor(idx)
            out[rows, : part.width] = lps.cpu()
            ids[rows, : part.width] = part_ids.cpu()
            top[rows, : part.width] = part_top.cpu()
    return out, ids, top
