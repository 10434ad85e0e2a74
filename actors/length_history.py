"""Expected response length per prompt, for length-aware dispatch (rollout.length_aware_dispatch). The controller
(actors/controller.py) records every scored group it receives and sends the expectation of each granted group
with its grant; the rollout worker (actors/decode_loop.py) hands its engine the longest-expected group first.

The predictor is honest: it reads a prompt's own `length_hint` when the data set provides one (computed from the
prompt, never from the answer), otherwise the lengths of that prompt's earlier groups in this run. A prompt never
seen has the mean over all groups seen so far: unknown prompts granted together keep their arrival order, and
sit between the prompts known to be short and those known to be long.
"""

from protocols.group_header import GroupHeader
from protocols.trajectory import Prompt

HINT_KEY = "length_hint"
"""Prompt metadata key of an optional expected response length in tokens, set by the data set."""


class LengthHistory:
    """Per-prompt expected response tokens from the groups seen so far (kept in memory, not in checkpoints: a
    resumed run rebuilds it)."""

    def __init__(self) -> None:
        self.means: dict[str, float] = {}
        """prompt_id -> mean response tokens of its groups, the newest group weighted half (lengths drift as the
        policy trains)."""
        self._total = 0.0
        self._groups = 0

    def record(self, group: GroupHeader) -> None:
        if not group.response_lengths:
            return
        prompt_id = group.prompt_id
        mean = sum(group.response_lengths) / len(group.response_lengths)
        previous = self.means.get(prompt_id)
        self.means[prompt_id] = mean if previous is None else (previous + mean) / 2
        self._total += mean
        self._groups += 1

    def expected(self, prompt: Prompt) -> float:
        hint = prompt.metadata.get(HINT_KEY)
        if hint is not None:
            return float(hint)
        seen = self.means.get(prompt.prompt_id)
        if seen is not None:
            return seen
        return self._total / self._groups if self._groups else 0.0
