"""Turning trajectories into model inputs, and scoring responses with a causal LM.

Two layouts. Padded (`collate`): a row is [left padding, prompt, response, right padding], every response starts
at the same column P, so the model computes outputs for the last T + 1 positions only (`logits_to_keep`).
Packed (`collate_packed`): all samples of a micro-batch in one row with no padding, positions restarting at 0
per sample and no attention mask, so transformers' masking (or flash-attention varlen on GPU) keeps attention
inside each sample. Per-token outputs are `(B, T)` over response positions either way. Pure torch.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from learner.kl import entropy_from_logits
from learner.logprobs import chunked_logprobs_entropy, chunked_topk_logprobs
from protocols.training_batch import TrainingBatch


@dataclass
class SampleBatch:
    """One micro-batch: model inputs (R, L) and per-token tensors (B, T) over the response."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """(R, L) 1 on real tokens; None for a packed row (the positions tell the samples apart)."""
    position_ids: torch.Tensor
    """(R, L) positions counted from each prompt's first token, as vLLM counts them."""
    score_mask: torch.Tensor
    """(B, T) bool: the response tokens the model scores, every one (model and tool tokens alike), so that a
    micro-batch with nothing to train still runs its forward and backward through the model; the loss then keeps
    only the TrainingBatch's loss_mask."""
    response_ids: torch.Tensor
    """(B, T) response token ids (pad where masked)."""
    score_index: torch.Tensor
    """(B, T) long: index into the model's kept outputs flattened to (R * keep, H) of the position that predicts
    each response token (0 where masked)."""
    keep: int
    """`logits_to_keep` for the forward pass: T + 1 padded, 0 (every position) packed."""

    @property
    def processed_tokens(self) -> int:
        """Positions the model runs over, padding included."""
        return int(self.input_ids.numel())


def collate(batch: TrainingBatch, pad_id: int) -> SampleBatch:
    """Padded rows [left padding, prompt, response, right padding] of a micro-batch; every response starts at
    the same column P. Every response token is scored (`score_mask`); which of them train is the batch's
    `loss_mask`, applied by the loss. Filled by masks, not row by row: a Python loop over 128 rows cost the demo's
    learner 0.02 to 0.03 s a step (docs/peers.md)."""
    n, width_t = batch.num_samples, batch.width
    prompt_lengths = torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.long)
    width_p = int(prompt_lengths.max())
    prompt_mask = torch.arange(width_p)[None, :] >= (width_p - prompt_lengths)[:, None]  # (B, P) left-padded
    response_mask = batch.token_mask  # (B, T)
    input_ids = torch.full((n, width_p + width_t), pad_id, dtype=torch.long)
    # a boolean mask assigns in row-major order: row i's prompt columns take its prompt tokens in order
    input_ids[:, :width_p][prompt_mask] = torch.tensor([t for p in batch.prompt_ids for t in p], dtype=torch.long)
    input_ids[:, width_p:][response_mask] = batch.response_ids[response_mask]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    # The last T + 1 outputs are kept; response token j of row b is predicted by kept output j.
    score_index = torch.arange(n)[:, None] * (width_t + 1) + torch.arange(width_t)[None, :]
    score_index = torch.where(response_mask, score_index, 0)
    return SampleBatch(input_ids, attention_mask, position_ids, response_mask, batch.response_ids.clone(), score_index,
                       width_t + 1)


def collate_packed(batch: TrainingBatch, pad_id: int) -> SampleBatch:
    """All samples in one row (1, sum of lengths), positions restarting per sample, no padding at all."""
    ids, positions = [], []
    width_t = batch.width
    score_index = torch.zeros((batch.num_samples, width_t), dtype=torch.long)
    offset = 0
    for i, (p, length) in enumerate(zip(batch.prompt_ids, batch.response_lengths.tolist())):
        ids.extend(p + batch.response_ids[i, :length].tolist())
        positions.extend(range(len(p) + length))
        # response token j sits at offset + len(p) + j and is predicted by the output one position earlier
        score_index[i, :length] = offset + len(p) - 1 + torch.arange(length)
        offset += len(p) + length
    score_mask = batch.token_mask
    score_index = torch.where(score_mask, score_index, 0)
    input_ids = torch.tensor([ids], dtype=torch.long)
    position_ids = torch.tensor([positions], dtype=torch.long)
    return SampleBatch(input_ids, None, position_ids, score_mask, batch.response_ids.clone(), score_index, 0)


def pad_per_token(values: list[list[float]], width: int) -> torch.Tensor:
    """Ragged per-token floats -> (B, width) float32, zero-padded."""
    lengths = torch.tensor([len(row) for row in values], dtype=torch.long)
    out = torch.zeros((len(values), width), dtype=torch.float32)
    out[torch.arange(width)[None, :] < lengths[:, None]] = torch.tensor([x for row in values for x in row],
                                                                       dtype=torch.float32)
    return out


def response_logits(model: torch.nn.Module, batch: SampleBatch, temperature: float) -> torch.Tensor:
    """(B, T, V) logits that predict each response token, divided by the sampling temperature (padded layout).

    Response token j sits at column P + j and is predicted by the output at P + j - 1, so the last T + 1 output
    positions are computed and the final one dropped.
    """
    width_t = batch.score_mask.size(1)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                logits_to_keep=width_t + 1, use_cache=False)
    logits = out.logits[:, :width_t].float()
    # Each (B, T, V) fp32 copy costs ~0.6 MB per token at a 151k vocabulary: skip the divide when it is a no-op.
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for (B, T, V) logits and (B, T) ids, without materializing all log-probs."""
    picked = torch.gather(logits, -1, token_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@contextmanager
def _scoring_head(model: torch.nn.Module, flat_index: torch.Tensor, targets: torch.Tensor, temperature: float,
                  chunk_tokens: int, top_k: int = 0):
    """Route the model's LM head through chunked_logprobs_entropy for one forward pass.

    The head module is still *called* by the model, so DeepSpeed ZeRO-3's module hooks gather its partitioned
    weight for the forward and again for the backward (reading `.weight` outside the call would see an empty
    shard). The head then returns (N, m + 1) [log-probs of the m targets a position, entropy] in place of logits;
    with `top_k` > 0 (no grad) it returns (N, 2 + 2k) [log-prob, entropy, k ids as floats, their log-probs]."""
    head = getattr(model, "module", model).get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_index)
        lp, ent = chunked_logprobs_entropy(h, head.weight, targets, bias=head.bias, temperature=temperature,
                                           chunk_tokens=chunk_tokens)
        out = [lp.reshape(h.shape[0], targets.shape[1] if targets.dim() == 2 else 1), ent[:, None]]
        if top_k:
            ids, top_lp = chunked_topk_logprobs(h, head.weight, top_k, bias=head.bias, temperature=temperature,
                                                chunk_tokens=chunk_tokens)
            out += [ids.double(), top_lp.double()]  # float64 holds any vocabulary's ids exactly
            out = [x.double() for x in out]
        return torch.cat(out, dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # back to the class's forward


def score_responses(model: torch.nn.Module, batch: SampleBatch, temperature: float,
                    chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs (B, T), entropy (B, T)) fp32 of each response token under `model` at `temperature`, 0 where
    score_mask is False; both carry grad when the model does. chunk_tokens > 0 scores through the LM head in
    chunks of that many positions (no (B, T, V) tensor); 0 materializes the logits (the original path)."""
    logprobs, entropy, _ = score_responses_at(model, batch, temperature, chunk_tokens)
    return logprobs, entropy


def _forward_args(batch: SampleBatch) -> dict:
    return dict(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                logits_to_keep=batch.keep, use_cache=False)


def _unflatten(mask: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """(N, ...) values of the True positions of `mask` (B, T) -> (B, T, ...), 0 elsewhere."""
    out = torch.zeros((*mask.shape, *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    out[mask] = flat
    return out


def score_responses_at(model: torch.nn.Module, batch: SampleBatch, temperature: float, chunk_tokens: int,
                       token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """score_responses, plus the log-probs of `token_ids` (B, T, k) at each response position ((B, T, k) fp32, 0
    where score_mask is False, with grad when the model has it; None without `token_ids`): the student's
    log-probs of the teacher's top-k tokens in the same forward that scores the sampled ones."""
    mask = batch.score_mask
    flat = batch.score_index[mask]
    targets = batch.response_ids[mask]
    if token_ids is not None:
        targets = torch.cat([targets[:, None], token_ids[mask]], dim=-1)
    m = targets.shape[1] if targets.dim() == 2 else 1  # ids scored a position
    if chunk_tokens > 0:
        with _scoring_head(model, flat, targets, temperature, chunk_tokens):
            scores = model(**_forward_args(batch)).logits
        lp_flat, ent_flat = scores[:, :-1], scores[:, -1]
    else:
        logits = model(**_forward_args(batch)).logits
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat).float()
        logits = logits if temperature == 1.0 else logits / temperature
        lp_flat = torch.gather(logits, -1, targets.reshape(len(flat), m)) - torch.logsumexp(logits, -1)[:, None]
        ent_flat = entropy_from_logits(logits[None])[0]
    lp_flat = lp_flat.reshape(len(flat), m)
    at = _unflatten(mask, lp_flat[:, 1:]) if token_ids is not None else None
    return _unflatten(mask, lp_flat[:, 0]), _unflatten(mask, ent_flat), at


@torch.no_grad()
def score_responses_topk(model: torch.nn.Module, batch: SampleBatch, temperature: float, chunk_tokens: int,
                         k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs (B, T), topk_ids (B, T, k) long, topk_logprobs (B, T, k)) under `model` at `temperature`, 0 where
    score_mask is False: the log-prob of each response token and the model's k most likely tokens at its position
    (a teacher's scores for top-k distillation). No grad."""
    mask = batch.score_mask
    flat = batch.score_index[mask]
    targets = batch.response_ids[mask]
    if chunk_tokens > 0:
        with _scoring_head(model, flat, targets, temperature, chunk_tokens, top_k=k):
            scores = model(**_forward_args(batch)).logits
        lp_flat, ids_flat, top_flat = scores[:, 0].float(), scores[:, 2:2 + k].long(), scores[:, 2 + k:].float()
    else:
        logits = model(**_forward_args(batch)).logits
        logits = logits.reshape(-1, logits.shape[-1]).index_select(0, flat).float()
        logits = logits if temperature == 1.0 else logits / temperature
        lp_flat = token_logprobs(logits, targets)
        top = logits.topk(k, dim=-1)
        ids_flat, top_flat = top.indices, top.values - torch.logsumexp(logits, -1, keepdim=True)
    return _unflatten(mask, lp_flat), _unflatten(mask, ids_flat), _unflatten(mask, top_flat)
