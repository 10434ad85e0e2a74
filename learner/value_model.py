"""The critic's network: a transformer body (the causal LM without its LM head) plus a scalar head, and how it
reads one value per response token from the same micro-batch layouts the policy uses (learner/batch.py).
Pure torch: the body is any module whose output has `last_hidden_state` (transformers' AutoModel).
"""

import torch
from torch import Tensor, nn

from learner.batch import SampleBatch


class ValueModel(nn.Module):
    """V(prefix) = w . h + b, with h the body's last hidden state at the prefix's last position."""

    def __init__(self, body: nn.Module, hidden_size: int, head_init_std: float = 0.0) -> None:
        super().__init__()
        self.body = body
        self.value_head = nn.Linear(hidden_size, 1)
        # A zero (or tiny) head starts every value near 0, so the first GAE advantages are the plain returns and
        # the body's pretrained features get no large random gradient before the head has learned anything.
        nn.init.normal_(self.value_head.weight, std=head_init_std) if head_init_std > 0 else \
            nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor) -> Tensor:
        """(R, L) ids -> (R, L) fp32 values at every position."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


def response_values(model: nn.Module, batch: SampleBatch) -> Tensor:
    """(B, T) fp32 value of the state before each response token (the position that predicts it, as the policy's
    log-probs use: learner/batch.score_index), 0 where score_mask is False; with grad when the model has it."""
    values = model(batch.input_ids, batch.attention_mask, batch.position_ids)
    keep = batch.keep if batch.keep > 0 else values.shape[1]
    flat = values[:, -keep:].reshape(-1)
    mask = batch.score_mask
    picked = flat.index_select(0, batch.score_index[mask])
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=picked.device)
    return zeros.masked_scatter(mask, picked)
