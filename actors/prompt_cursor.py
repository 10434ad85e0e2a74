"""The prompt cursor: the controller's position in the training prompts.

An endless pass over the prompts, reshuffled each epoch from the run's seed, so a checkpoint saves only the
(epoch, index) pair and a resumed run continues with the same order.
"""

import random

from protocols.trajectory import Prompt


class PromptCursor:
    """Endless shuffled pass over the training prompts; the (epoch, index) pair is the data position."""

    def __init__(self, prompts: list[Prompt], seed: int) -> None:
        if not prompts:
            raise ValueError(
                "the training set is empty after filtering; check data.train_path and data.max_prompt_tokens")
        self.prompts = prompts
        self.seed = seed
        self.epoch = 0
        self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> Prompt:
        if self.index == len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._shuffled(self.epoch)
        prompt = self.prompts[self._order[self.index]]
        self.index += 1
        return prompt

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)
