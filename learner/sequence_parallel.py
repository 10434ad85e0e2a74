"""Sequence parallelism (Ulysses, the scheme of DeepSpeed's ALST for Hugging Face models): the ranks of one
sequence-parallel (SP) group share one row of tokens, each holding a 1/sp slice of it along T. Everything but
attention is per token, so it runs on the slice; attention swaps the sequence slice for a head slice with an
all-to-all (each rank then sees the whole sequence for 1/sp of the heads) and swaps back afterwards.

The learner packs samples into a row (`pack_row`), cuts this rank's slice (`shard_row`), runs the decoder with
the attention swapped in (`install_ulysses_attention`, learner/ulysses_attention.py) and scores the slice's
response tokens (`sequence_parallel_logprobs`). Loss shares are sums over tokens divided by global counts, so summing the SP ranks' gradients
gives the unsplit gradient. Pure torch; the DeepSpeed side is in learner/sequence_parallel_rank.py.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from learner.batch import _scoring_head
from protocols.training_batch import TrainingBatch

# --- groups -------------------------------------------------------------------------------------------------------


def sequence_parallel_layout(world_size: int, sp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(sp_groups, dp_groups) of global ranks. SP groups are runs of consecutive ranks, as in DeepSpeed's
    parallel_state_sp (so an SP group stays inside a node, where the all-to-alls are cheapest); the ranks at the
    same place in each SP group form a data-parallel group. world 4, sp 2: sp [[0, 1], [2, 3]], dp [[0, 2], [1, 3]]."""
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(
            f"learner.sequence_parallel_size={sp_size} does not divide the {world_size} learner ranks; "
            f"use a size that divides learner.num_ranks"
        )
    sp_groups = [list(range(start, start + sp_size)) for start in range(0, world_size, sp_size)]
    dp_groups = [list(range(offset, world_size, sp_size)) for offset in range(sp_size)]
    return sp_groups, dp_groups


@dataclass
class SequenceParallelGroups:
    """This rank's place in the data-parallel x sequence-parallel grid, with its process groups."""

    sp_group: dist.ProcessGroup | None
    """Ranks sharing one row (all-to-alls in attention, gradient sum)."""
    dp_group: dist.ProcessGroup | None
    """Ranks at the same SP position in each SP group (they see different samples)."""
    world_group: dist.ProcessGroup | None
    """All ranks: ZeRO partitions and reduces gradients over sp x dp."""
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int


def build_sequence_parallel_groups(sp_size: int) -> SequenceParallelGroups:
    """Create the SP and DP process groups of `sequence_parallel_layout`. Collective: every rank calls it, once,
    after the default process group is up (torch.distributed.new_group must see the same calls on all ranks)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sp_groups, dp_groups = sequence_parallel_layout(world_size, sp_size)
    mine: dict[str, dist.ProcessGroup] = {}
    for kind, layout in (("sp", sp_groups), ("dp", dp_groups)):
        for ranks in layout:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    world_group = dist.new_group(list(range(world_size)))
    return SequenceParallelGroups(
        sp_group=mine["sp"], dp_group=mine["dp"], world_group=world_group,
        sp_rank=rank % sp_size, sp_size=sp_size, dp_rank=rank // sp_size, dp_size=world_size // sp_size,
    )


# --- rows and slices ------------------------------------------------------------------------------------------


@dataclass
class SequenceRow:
    """Samples laid end to end in rows, in prediction coordinates: column c holds a token and what it predicts.
    All tensors are (B, L); `pack_row` builds B = 1."""

    input_ids: Tensor
    position_ids: Tensor
    """Positions restart at 0 at each packed sample: attention never crosses a restart."""
    target_ids: Tensor
    """The token column c predicts: the next token of the same sample (pad after a sample's last token)."""
    loss_mask: Tensor
    """bool: True where the target is a token that trains (the batch's loss_mask at its predicting column)."""
    score_mask: Tensor
    """bool: True where the target is any response token (scored, as collate scores them, whether it trains or
    not)."""
    sample_index: Tensor
    """Which packed sample the column belongs to; -1 on padding."""
    per_token: dict[str, Tensor] = field(default_factory=dict)
    """Per response-token values (behavior_logprobs, advantages, ...) at the column that predicts the token; 0
    elsewhere."""
    response_columns: list[list[int]] = field(default_factory=list)
    """Per sample, the row columns (in the unsharded row) that predict its response tokens, in order."""
    start: int = 0
    """Column of the unsharded row where this slice starts (0 for a whole row)."""


def pack_row(batch: TrainingBatch, pad_id: int, per_token: tuple[str, ...] = (), multiple_of: int = 1) -> SequenceRow:
    """Pack the samples of `batch` (prompt + response each) into one row, right-padded to a multiple of
    `multiple_of` (the SP size, so every rank gets an equal slice). Response token j of a sample whose prompt has
    P tokens sits at the sample's column P + j and is predicted by column P + j - 1, where its loss-mask flag and
    its per-token values (the batch's fields named in `per_token`) go. Padding continues the last sample's
    positions, so a one-sample row stays one causal sequence (no mask needed)."""
    if batch.num_samples == 0:
        raise ValueError("pack_row needs at least one sample")
    ids: list[int] = []
    positions: list[int] = []
    samples: list[int] = []
    response_columns: list[list[int]] = []
    lengths = batch.response_lengths.tolist()
    for i, (prompt, length) in enumerate(zip(batch.prompt_ids, lengths)):
        if not prompt:
            raise ValueError(f"sample {i} has an empty prompt: its first response token would have no position "
                             f"predicting it")
        offset = len(ids)
        ids.extend(prompt + batch.response_ids[i, :length].tolist())
        positions.extend(range(len(prompt) + length))
        samples.extend([i] * (len(prompt) + length))
        response_columns.append([offset + len(prompt) + j - 1 for j in range(length)])
    length = -(-len(ids) // multiple_of) * multiple_of
    num_pad = length - len(ids)
    positions.extend(range(positions[-1] + 1, positions[-1] + 1 + num_pad))
    samples.extend([-1] * num_pad)
    ids.extend([pad_id] * num_pad)

    target_ids = torch.full((1, length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((1, length), dtype=torch.bool)
    score_mask = torch.zeros((1, length), dtype=torch.bool)
    values = {name: torch.zeros((1, length), dtype=torch.float32) for name in per_token}
    for i, (columns, n) in enumerate(zip(response_columns, lengths)):
        if not columns:
            continue
        cols = torch.tensor(columns)
        target_ids[0, cols] = batch.response_ids[i, :n]
        loss_mask[0, cols] = batch.loss_mask[i, :n].cpu()
        score_mask[0, cols] = True
        for name in per_token:
            values[name][0, cols] = getattr(batch, name)[i, :n].float().cpu()
    # Prompt columns predict the next prompt token too; only the response is scored, so they keep pad targets.
    return SequenceRow(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([positions], dtype=torch.long),
        target_ids=target_ids, loss_mask=loss_mask, score_mask=score_mask,
        sample_index=torch.tensor([samples], dtype=torch.long),
        per_token=values, response_columns=response_columns,
    )


def shard_row(row: SequenceRow, sp_rank: int, sp_size: int) -> SequenceRow:
    """SP rank `sp_rank`'s slice of a row: columns [sp_rank * S, (sp_rank + 1) * S) with S = L / sp_size. Targets
    were set on the whole row, so the last column of slice r predicts the first token of slice r + 1."""
    length = row.input_ids.size(1)
    if length % sp_size:
        raise ValueError(f"a row of {length} columns does not split over learner.sequence_parallel_size={sp_size}; "
                         f"pack it with multiple_of={sp_size}")
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is outside the SP group of {sp_size} ranks")
    size = length // sp_size
    cols = slice(sp_rank * size, (sp_rank + 1) * size)
    return replace(
        row,
        input_ids=row.input_ids[:, cols], position_ids=row.position_ids[:, cols],
        target_ids=row.target_ids[:, cols], loss_mask=row.loss_mask[:, cols], score_mask=row.score_mask[:, cols],
        sample_index=row.sample_index[:, cols],
        per_token={name: value[:, cols] for name, value in row.per_token.items()},
        start=row.start + sp_rank * size,
    )


def per_sample_to_columns(row: SequenceRow, values: Tensor) -> Tensor:
    """(B, L) tensor holding `values[i]` (one per packed sample, shape (N,)) on sample i's columns and 0 (False)
    on padding. For the sample mask, or a per-sequence divisor such as 1 / |y_i| of seq_mean_token_mean: a slice
    may hold part of a sample, so such counts must come from the whole sample, not from the slice's loss_mask."""
    index = row.sample_index.clamp(min=0)
    picked = values.to(row.sample_index.device)[index]
    return torch.where(row.sample_index >= 0, picked, torch.zeros((), dtype=values.dtype, device=picked.device))


def response_values(row_values: Tensor, row: SequenceRow, width: int) -> Tensor:
    """(B, width) per-sample response values (e.g. log-probs) from a (1, L) tensor over the whole row's columns,
    0 past each response."""
    out = torch.zeros((len(row.response_columns), width), dtype=row_values.dtype)
    for i, columns in enumerate(row.response_columns):
        if columns:
            out[i, : len(columns)] = row_values[0, torch.tensor(columns)]
    return out


def gather_sequence(shard_values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenate the SP ranks' (B, S) slices along T into (B, L), in SP rank order. No gradient (for scoring)."""
    parts = [torch.empty_like(shard_values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard_values.contiguous(), group=group)
    return torch.cat(parts, dim=1)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; every rank's output depends on every rank's input, so the backward sums the
    gradients the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def sequence_mean_over_group(shard: SequenceRow, lengths: Tensor,
                             group: dist.ProcessGroup | None) -> Callable[[Tensor], Tensor]:
    """For whole-sequence quantities on a slice (GSPO's sequence ratio, sequence-level off-policy masks): a
    function mapping per-token values (1, S), 0 off the loss mask, to the mean over each column's whole sample,
    sum over every slice of the row (an all-reduce over the SP group) / lengths[i] (its loss tokens |y_i|, (N,)).
    Differentiable; 0 on padding. Every SP rank must call it as often, in the same order."""
    index = shard.sample_index[0].clamp(min=0)
    real = shard.sample_index[0] >= 0

    def mean(values: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=values.dtype, device=values.device)
        local = torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device).index_add(
            0, index, torch.where(real, values[0], zero))
        total = _AllReduceSum.apply(local, group)
        return per_sample_to_columns(shard, total / lengths.to(values.dtype).clamp(min=1))

    return mean


# --- scoring ------------------------------------------------------------------------------------------------------


def sequence_parallel_hidden_states(model: torch.nn.Module, shard: SequenceRow) -> Tensor:
    """(B, S, hidden) final hidden states of this rank's slice. `model` is the HF causal LM (under DeepSpeed,
    `engine.module`) with `install_ulysses_attention` applied; every SP rank must call it together."""
    out = model.get_decoder()(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False)
    return out.last_hidden_state


def token_logprobs_from_hidden(hidden: Tensor, lm_head: torch.nn.Module, target_ids: Tensor,
                               temperature: float = 1.0) -> Tensor:
    """(B, S) fp32 log p(target) from hidden states. Materializes (B, S, V) for the slice only; a chunked scorer
    with the same signature can replace it."""
    logits = lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, target_ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_parallel_logprobs(model: torch.nn.Module, shard: SequenceRow, temperature: float = 1.0,
                               score: Callable[..., Tensor] = token_logprobs_from_hidden) -> Tensor:
    """(B, S) log-probs of the targets of this rank's slice (meaningful where `shard.loss_mask`). Gradients flow
    through the all-to-alls: after backward, the sum over the SP group of each rank's parameter gradients is the
    gradient of the whole row (so reduce with SUM over SP ranks, never the mean)."""
    hidden = sequence_parallel_hidden_states(model, shard)
    return score(hidden, model.get_output_embeddings(), shard.target_ids, temperature)


def sequence_parallel_scores(model: torch.nn.Module, shard: SequenceRow, temperature: float,
                             chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """(logprobs (B, S), entropy (B, S)) fp32 of this slice's response targets, 0 off `shard.score_mask`, with grad
    when the model has it. The LM head runs through learner/logprobs.py's chunked scorer on the slice's scored
    positions only (the head module is still called, so ZeRO-3 gathers its weight), so no (S, V) logits tensor
    exists; chunk_tokens 0 scores them all in one chunk. `model` is the HF model or a DeepSpeed engine around it;
    every SP rank must call it together."""
    module = getattr(model, "module", model)
    mask = shard.score_mask
    flat = mask.reshape(-1).nonzero().squeeze(1)
    targets = shard.target_ids[mask]
    chunk = chunk_tokens if chunk_tokens > 0 else max(1, int(flat.numel()))
    head = module.get_output_embeddings()
    with _scoring_head(module, flat, targets, temperature, chunk):
        chunked = head.forward

        def forward(hidden: Tensor) -> Tensor:
            # `hidden * 0` ties the scores to the decoder even on a slice with nothing to score (all prompt, or a
            # masked sample): its backward still runs the attention all-to-alls, which every SP rank must join.
            return chunked(hidden) + hidden.sum().float() * 0

        head.forward = forward
        # The whole model (the engine itself when given one), so DeepSpeed's forward hooks run as they do without SP.
        scores = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=scores.device)
    return zeros.masked_scatter(mask, scores[:, 0]), zeros.masked_scatter(mask, scores[:, 1])
