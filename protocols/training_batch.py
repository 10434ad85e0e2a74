"""The training batch: one typed record of a step's samples, built once by the driver from the scored groups.

Everything on the way from the replay queue to the gradient reads it: shaping, the KL in the reward, advantages
and GAE, the loss normalizers, the plan over ranks and micro-batches, collate and packing, sequence parallelism,
the policy and value losses. `loss_mask` is the one rule of which tokens train: 1 on tokens the engine sampled
in a kept sample; 0 on padding, on tool output (context only) and on samples the shaping dropped. No consumer
re-derives it from lengths. Per-token tensors are `(B, T)` over response positions, padded once here; a shard
or micro-batch is `select(indices)`. Pure torch: it pickles through Ray and saves with `save`/`load`.
"""

from array import array
from dataclasses import dataclass, fields, replace
from itertools import chain
from pathlib import Path

import torch
from torch import Tensor

from protocols.trajectory import TOKEN_SCORERS

SCORED_PER_TOKEN = ("advantages", *TOKEN_SCORERS.values(), "values", "returns", "proximal_logprobs")
"""The optional `(B, T)` float fields: the frozen token scorers' log-probs (protocols.trajectory.TOKEN_SCORERS),
the critic's values, and what the driver and the learner add."""
PER_TOKEN = ("response_ids", "loss_mask", "behavior_logprobs", *SCORED_PER_TOKEN)
"""The `(B, T)` fields; `select` trims them to the selected samples' longest response."""

PER_POSITION_K = ("teacher_topk_ids", "teacher_topk_logprobs")
"""The `(B, T, k)` fields: k values at every response position; `select` trims them as the `(B, T)` ones."""

PER_SAMPLE = ("response_lengths", "sample_mask", "rewards", "truncated")
"""The `(B,)` fields."""
OPTIONAL_PER_SAMPLE = ("group_index",)
"""The optional `(B,)` fields."""


@dataclass
class TrainingBatch:
    """B samples (whole groups from the queue, or a shard or micro-batch of them). Who produced each field is in
    its name: `behavior_logprobs` by vLLM at sampling, `ref_logprobs` by the frozen reference, `teacher_logprobs`
    by the teacher, `values` by the critic, `advantages`/`returns` by the driver, `proximal_logprobs` by the
    learner before the update."""

    prompt_ids: list[list[int]]
    """Token ids of each prompt (ragged; a packed or padded layout is built from them per micro-batch)."""
    response_ids: Tensor
    """(B, T) long: every response token in order, model and tool tokens alike; 0 past the response's end."""
    response_lengths: Tensor
    """(B,) long: response tokens of each sample (what the model reads as context after the prompt)."""
    loss_mask: Tensor
    """(B, T) bool: True on tokens that train, i.e. sampled by the engine, in a sample `sample_mask` keeps."""
    behavior_logprobs: Tensor
    """(B, T) float32: log mu(token) from vLLM when it sampled the token; 0 off the engine's tokens."""
    sample_mask: Tensor
    """(B,) bool: False for samples dropped from the loss (e.g. truncated ones with algorithm.mask_truncated)."""
    rewards: Tensor
    """(B,) float32: the verifier's reward (before the algorithm's shaping)."""
    truncated: Tensor
    """(B,) bool: the sample ran out of rollout.max_response_tokens (finish reason `length`) or of tools.max_turns
    (`max_turns`): Trajectory.truncated."""
    advantages: Tensor | None = None
    """(B, T) float32, set by the driver (learner/objective.py compute_advantages)."""
    ref_logprobs: Tensor | None = None
    """(B, T) float32 log pi_ref(token): streamed by reference workers, or scored once by the learner group."""
    teacher_logprobs: Tensor | None = None
    """(B, T) float32 log pi_teacher(token): streamed by teacher workers (on-policy distillation)."""
    teacher_topk_ids: Tensor | None = None
    """(B, T, k) long: the teacher's k most likely ids at each position (algorithm.distillation.top_k = k > 0);
    0 past a response's end."""
    teacher_topk_logprobs: Tensor | None = None
    """(B, T, k) float32: the teacher's log-probs of those ids; 0 past a response's end."""
    values: Tensor | None = None
    """(B, T) float32 V(state before each token), from PPO's critic at train time (CriticPool.score_batch)."""
    returns: Tensor | None = None
    """(B, T) float32 GAE returns, the critic's regression targets (PPO)."""
    proximal_logprobs: Tensor | None = None
    """(B, T) float32: the policy's log-probs before the batch's first update (several updates per batch)."""
    group_index: Tensor | None = None
    """(B,) long: the group (prompt) of each sample, numbered 0, 1, ... in the batch's order, from the
    trajectories' group ids. The advantages take rows [g*G:(g+1)*G] as one group; learner/prepare.py checks
    the rows against it."""

    def __post_init__(self) -> None:
        b, t = self.response_ids.shape
        if len(self.prompt_ids) != b:
            raise ValueError(f"TrainingBatch: {len(self.prompt_ids)} prompts for {b} responses")
        for name in PER_TOKEN:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, t):
                raise ValueError(f"TrainingBatch.{name} has shape {tuple(value.shape)}, expected {(b, t)}")
        shapes = {tuple(getattr(self, name).shape) for name in PER_POSITION_K if getattr(self, name) is not None}
        if shapes and (len(shapes) > 1 or next(iter(shapes))[:2] != (b, t) or len(next(iter(shapes))) != 3
                       or self.teacher_topk_ids is None or self.teacher_topk_logprobs is None):
            raise ValueError(f"TrainingBatch.teacher_topk_ids and teacher_topk_logprobs must both be (B, T, k) with "
                             f"(B, T) = {(b, t)}; got shapes {sorted(shapes)}")
        for name in PER_SAMPLE + OPTIONAL_PER_SAMPLE:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b,):
                raise ValueError(f"TrainingBatch.{name} has shape {tuple(value.shape)}, expected {(b,)}")
        if bool((self.loss_mask & ~self.token_mask).any()):
            raise ValueError("TrainingBatch.loss_mask is True past a response's end: only response tokens train")

    # --- building -------------------------------------------------------------------------------------------------
    @classmethod
    def from_samples(cls, prompt_ids: list[list[int]], response_ids: list[list[int]],
                     behavior_logprobs: list[list[float]] | None = None, *,
                     model_token_mask: list[list[bool]] | None = None,
                     sample_mask: list[bool] | None = None, rewards: list[float] | None = None,
                     truncated: list[bool] | None = None, teacher_topk_ids: list[list[list[int]]] | None = None,
                     teacher_topk_logprobs: list[list[list[float]]] | None = None,
                     group_index: list[int] | None = None,
                     **per_token: list[list[float]] | None) -> "TrainingBatch":
        """A batch from ragged per-sample lists, padded once. `model_token_mask`: True on tokens the engine
        sampled (default: every response token); `loss_mask` is that AND `sample_mask`. `per_token`: optional
        SCORED_PER_TOKEN fields (advantages, ref_logprobs, teacher_logprobs, values, returns, proximal_logprobs),
        one list per sample, one value a token. `teacher_topk_ids` / `teacher_topk_logprobs`: (T, k) per sample,
        both or neither."""
        n = len(response_ids)
        lengths = torch.tensor([len(r) for r in response_ids], dtype=torch.long)
        width = max(1, int(lengths.max())) if n else 1
        model_tokens = (_pad(model_token_mask, width, torch.bool)
                        if model_token_mask is not None else torch.arange(width)[None, :] < lengths[:, None])
        keep = torch.tensor(sample_mask if sample_mask is not None else [True] * n, dtype=torch.bool)
        unknown = set(per_token) - set(SCORED_PER_TOKEN)
        if unknown:
            raise TypeError(f"TrainingBatch.from_samples got unknown per-token fields {sorted(unknown)}")
        ragged = {"behavior_logprobs": behavior_logprobs, "model_token_mask": model_token_mask,
                  "teacher_topk_ids": teacher_topk_ids,
                  "teacher_topk_logprobs": teacher_topk_logprobs, **per_token}
        for name, rows in ragged.items():
            for i, row in enumerate(rows or []):
                if len(row) != len(response_ids[i]):
                    raise ValueError(f"per-token `{name}` of sample {i} has {len(row)} values for "
                                     f"{len(response_ids[i])} response tokens")
        return cls(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=_pad(response_ids, width, torch.long),
            response_lengths=lengths,
            loss_mask=model_tokens & keep[:, None],
            behavior_logprobs=(_pad(behavior_logprobs, width, torch.float32) if behavior_logprobs is not None
                               else torch.zeros((n, width))),
            sample_mask=keep,
            rewards=torch.tensor(rewards if rewards is not None else [0.0] * n, dtype=torch.float32),
            truncated=torch.tensor(truncated if truncated is not None else [False] * n, dtype=torch.bool),
            teacher_topk_ids=_pad_k(teacher_topk_ids, width, torch.long),
            teacher_topk_logprobs=_pad_k(teacher_topk_logprobs, width, torch.float32),
            group_index=torch.tensor(group_index, dtype=torch.long) if group_index is not None else None,
            **{k: _pad(v, width, torch.float32) for k, v in per_token.items() if v is not None},
        )

    @classmethod
    def from_trajectories(cls, trajectories: list) -> "TrainingBatch":
        """The batch of scored `protocols.trajectory.Trajectory` records, in order: which tokens the engine
        sampled comes from each trajectory's own `loss_mask`; `ref_logprobs` and `teacher_logprobs` are taken
        when every trajectory carries them (reference and teacher workers score them in the stream), as are the
        teacher's top-k ids and log-probs (PPO's critic adds `values` at train time). `group_index` numbers their group ids in order."""
        def every(name: str) -> list | None:
            rows = [getattr(t, name) for t in trajectories]
            return None if any(r is None for r in rows) else rows

        groups: dict[str, int] = {}
        group_index = [groups.setdefault(t.group_id, len(groups)) for t in trajectories]

        return cls.from_samples(
            [t.prompt.prompt_token_ids for t in trajectories], [t.response_token_ids for t in trajectories],
            [t.behavior_logprobs for t in trajectories], model_token_mask=[t.loss_mask for t in trajectories],
            rewards=[t.reward for t in trajectories],
            truncated=[t.truncated for t in trajectories], group_index=group_index,
            **{name: every(name) for name in TOKEN_SCORERS.values()},
            teacher_topk_ids=every("teacher_topk_ids"), teacher_topk_logprobs=every("teacher_topk_logprobs"))

    # --- reading --------------------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return len(self.prompt_ids)

    @property
    def width(self) -> int:
        """T: the longest response (at least 1, so an all-empty batch still has a column)."""
        return int(self.response_ids.shape[1])

    @property
    def token_mask(self) -> Tensor:
        """(B, T) bool: True on every response token, model or tool; the layout, not what trains."""
        return torch.arange(self.width, device=self.response_lengths.device)[None, :] < self.response_lengths[:, None]

    def sample_tokens(self) -> list[int]:
        """Prompt + response tokens of each sample: what a micro-batch's token budget counts."""
        return [len(p) + int(n) for p, n in zip(self.prompt_ids, self.response_lengths.tolist())]

    def response(self, i: int) -> list[int]:
        """Sample i's response token ids."""
        return self.response_ids[i, : int(self.response_lengths[i])].tolist()

    def per_sample_rows(self, values: Tensor) -> list[list[float]]:
        """A (B, T) tensor of this batch cut back to per-sample lists of response length."""
        return [row[: int(n)].tolist() for row, n in zip(values.cpu(), self.response_lengths.tolist())]

    # --- splitting ------------------------------------------------------------------------------------------------
    def select(self, indices: list[int]) -> "TrainingBatch":
        """The samples `indices`, in that order, their per-token fields trimmed to their longest response."""
        index = torch.tensor(indices, dtype=torch.long)
        lengths = self.response_lengths[index]
        width = max(1, int(lengths.max())) if len(indices) else 1
        update: dict = {"prompt_ids": [self.prompt_ids[i] for i in indices]}
        for name in PER_TOKEN + PER_POSITION_K:
            value = getattr(self, name)
            update[name] = None if value is None else value[index, :width]
        for name in PER_SAMPLE + OPTIONAL_PER_SAMPLE:
            value = getattr(self, name)
            update[name] = None if value is None else value[index]
        return replace(self, **update)

    def masked(self) -> "TrainingBatch":
        """The same samples with nothing to train on: the stand-in a rank runs for a padding micro-batch, so its
        collectives line up with the other ranks'."""
        return replace(self, loss_mask=torch.zeros_like(self.loss_mask),
                       sample_mask=torch.zeros_like(self.sample_mask))

    def with_sample_mask(self, sample_mask: Tensor) -> "TrainingBatch":
        """Drop the samples where `sample_mask` (B,) is False from the loss (reward shaping's rule)."""
        keep = self.sample_mask & sample_mask.bool()
        return replace(self, sample_mask=keep, loss_mask=self.loss_mask & keep[:, None])

    def with_fields(self, **fields_: Tensor | None) -> "TrainingBatch":
        """A copy with some fields replaced (e.g. advantages, ref_logprobs), checked like a new batch."""
        return replace(self, **fields_)

    def to(self, device: torch.device) -> "TrainingBatch":
        """Tensors on `device` (the learner rank's)."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if torch.is_tensor(getattr(self, f.name))})

    # --- disk -----------------------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        torch.save({f.name: getattr(self, f.name) for f in fields(self)}, path)

    @classmethod
    def load(cls, path: str | Path) -> "TrainingBatch":
        return cls(**torch.load(path, weights_only=True))


def _pad_k(rows: list[list[list]] | None, width: int, dtype: torch.dtype) -> Tensor | None:
    """(T_i, k) per sample -> (B, width, k), zero-padded; None stays None."""
    if rows is None:
        return None
    k = next((len(row[0]) for row in rows if row), 0)
    out = torch.zeros((len(rows), width, k), dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            if any(len(position) != k for position in row):
                raise ValueError(f"sample {i}: the teacher's top-k rows must all hold k={k} values")
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _pad(rows: list[list], width: int, dtype: torch.dtype, fill: int | float = 0) -> Tensor:
    """Rows of lengths T_i -> (B, width), `fill` after each row's end. One tensor of all the values, scattered
    through a mask (`masked_scatter_`, ten times faster than assigning through the mask): a tensor per row cost
    about 7 ms a step for the addition demo's 128 short rows."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    if int(lengths.sum()):
        out.masked_scatter_(torch.arange(width) < lengths[:, None], _flat(rows, dtype))
    return out


ARRAY_CODES = {torch.float32: "f", torch.long: "q", torch.bool: "b"}
"""The `array` type code each padded dtype is read through: `torch.frombuffer` over an array makes a tensor of a
long list about 2.7 times faster than `torch.tensor` does. The driver collates every step's batch: 64 samples of
4,096 tokens took a median 180 ms, now 100 ms with `_pad`'s scatter (2 CPU cores)."""


def _flat(rows: list[list], dtype: torch.dtype) -> Tensor:
    """Every value of `rows` in order, as one 1-D tensor of `dtype`, converted as `torch.tensor` converts them
    (float32 rounding, non-zero is True). A value the array cannot take (a float among integers, an integer past
    64 bits) takes `torch.tensor`'s path."""
    code = ARRAY_CODES.get(dtype)
    if code is not None:
        try:
            flat = torch.frombuffer(array(code, chain.from_iterable(rows)),
                                    dtype=torch.int8 if dtype == torch.bool else dtype)
            return flat != 0 if dtype == torch.bool else flat
        except (TypeError, OverflowError):
            pass
    return torch.tensor(list(chain.from_iterable(rows)), dtype=dtype)
