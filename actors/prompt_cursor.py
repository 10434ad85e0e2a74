"""The prompt cursor: the controller's position in the training prompts.

An endless pass over the prompts, reshuffled each epoch from the run's seed, so a checkpoint saves only the
(epoch, index) pair and a resumed run continues with the same order.

A mixture (`data.tasks` with weights; each prompt's `metadata.data_source` names its task) keeps one such pass
per source and draws the sources in proportion to their weights: the next prompt comes from the source furthest
behind its share (the fewest draws per unit of weight, ties to the first source). After n draws every source has
its share of n to within one prompt, at every point of the run, whatever the sources' sizes.
"""

import random

from protocols.trajectory import Prompt


class _Pass:
    """Endless shuffled pass over `indices` (positions in the cursor's prompt list)."""

    def __init__(self, indices: list[int], seed: int) -> None:
        self.indices, self.seed = indices, seed
        self.epoch = self.index = 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(self.indices)
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> int:
        if self.index == len(self._order):
            self.epoch += 1
            self.index = 0
            self._order = self._shuffled(self.epoch)
        self.index += 1
        return self._order[self.index - 1]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._shuffled(self.epoch)


class PromptCursor:
    """Endless shuffled pass over the training prompts (per source, drawn by weight, for a mixture)."""

    def __init__(self, prompts: list[Prompt], seed: int, weights: dict[str, float] | None = None) -> None:
        """`weights`: {data_source: weight} of a mixture; None or {} for one shuffled pass over every prompt."""
        if not prompts:
            raise ValueError(
                "the training set is empty after filtering; check data.train_path and data.max_prompt_tokens")
        self.prompts = prompts
        self.weights = dict(weights or {})
        if not self.weights:
            self.passes = {"": _Pass(list(range(len(prompts))), seed)}
        else:
            by_source: dict[str, list[int]] = {source: [] for source in self.weights}
            for i, prompt in enumerate(prompts):
                source = prompt.metadata.get("data_source")
                if source not in by_source:
                    raise ValueError(f"prompt {prompt.prompt_id!r} has data_source {source!r}, not one of the "
                                     f"mixture's sources {sorted(self.weights)}")
                by_source[source].append(i)
            empty = sorted(source for source, indices in by_source.items() if not indices)
            if empty:
                raise ValueError(f"data.tasks {empty} have no training prompt left after filtering (all over "
                                 "data.max_prompt_tokens?); raise data.max_prompt_tokens or remove them")
            # each source's own shuffle, from the run's seed and the source's place in the mixture
            self.passes = {source: _Pass(indices, seed + 7919 * k) for k, (source, indices) in
                           enumerate(by_source.items())}
        self.drawn = {source: 0 for source in self.passes}
        """Prompts drawn from each source so far (the run's shares: `data/drawn_<source>`)."""

    @property
    def epoch(self) -> int:
        """Complete passes over the prompts (over the source least far through, for a mixture)."""
        return min(p.epoch for p in self.passes.values())

    def next(self) -> Prompt:
        if self.weights:
            source = min(self.passes, key=lambda s: self.drawn[s] / self.weights[s])
        else:
            source = ""
        self.drawn[source] += 1
        return self.prompts[self.passes[source].next()]

    def state_dict(self) -> dict:
        if not self.weights:
            return self.passes[""].state_dict()
        return {"sources": {s: {**p.state_dict(), "drawn": self.drawn[s]} for s, p in self.passes.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not self.weights:
            self.passes[""].load_state_dict(state)
            return
        if set(state.get("sources", {})) != set(self.passes):
            raise ValueError(f"the checkpoint's prompt cursor holds sources {sorted(state.get('sources', {}))}, but "
                             f"this run's mixture has {sorted(self.passes)}: resume with the data.tasks it ran with")
        for source, saved in state["sources"].items():
            self.passes[source].load_state_dict(saved)
            self.drawn[source] = saved["drawn"]

    def metrics(self) -> dict[str, float]:
        """data/drawn_<source>: prompts drawn from each source of a mixture ({} for one source)."""
        return {f"data/drawn_{s}": float(n) for s, n in self.drawn.items()} if self.weights else {}
