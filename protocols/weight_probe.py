"""The weight-sync check's probe: a few fixed token sequences that a rollout engine and the learner both score
after a version is loaded, and the comparison of their log-probs.

Both sides build the same probe from the tokenizer's size and `weight_sync.verify_*` alone (no data, nothing to
ship): the engine scores it after it loads a checked version (actors/weight_probe_requests.py), the learner
right after it publishes that version, and the driver compares the two (weights/sync_check.py). Pure Python.
"""

import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightProbe:
    """`sequences` prompts and responses of fixed token ids; only the response tokens are compared."""

    prompt_ids: tuple[tuple[int, ...], ...]
    response_ids: tuple[tuple[int, ...], ...]

    @property
    def longest(self) -> int:
        """Tokens of the longest prompt + response: what must fit the engine's context."""
        return max(len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids))

    @property
    def digest(self) -> int:
        """crc32 of every token id: the engine's result carries it, so a probe built differently on the two sides
        is named as such, not taken for a bad load."""
        text = "|".join(",".join(map(str, ids)) for ids in (*self.prompt_ids, *self.response_ids))
        return zlib.crc32(text.encode())


def build_weight_probe(vocab_size: int, sequences: int, prompt_tokens: int, response_tokens: int,
                       seed: int = 0) -> WeightProbe:
    """Token ids spread over the whole vocabulary, from crc32(seed/sequence/position), so they reach many rows of
    the embedding and `lm_head` and are the same in every process and every run with these arguments."""
    if vocab_size < 1:
        raise ValueError(f"the weight-sync probe needs a tokenizer with at least one token, got {vocab_size}")

    def ids(i: int, part: str, n: int) -> tuple[int, ...]:
        return tuple(zlib.crc32(f"probe/{seed}/{i}/{part}/{j}".encode()) % vocab_size for j in range(n))

    return WeightProbe(tuple(ids(i, "prompt", prompt_tokens) for i in range(sequences)),
                       tuple(ids(i, "response", response_tokens) for i in range(sequences)))


def check_probe_fits(probe: WeightProbe, context_tokens: int) -> None:
    """Refuse a probe the engine cannot score: its prompt + response, plus the one token a request must sample,
    must fit the engine's context (data.max_prompt_tokens + rollout.max_response_tokens, fitted to the model)."""
    if probe.longest + 1 > context_tokens:
        raise ValueError(
            f"weight_sync.verify_prompt_tokens + weight_sync.verify_response_tokens = {probe.longest} tokens (and "
            f"the one token the engine samples) do not fit the rollout engine's context of {context_tokens} tokens "
            "(data.max_prompt_tokens + rollout.max_response_tokens, fitted to the model): lower them so their sum "
            f"is at most {context_tokens - 1}, or set weight_sync.verify_every=0 to turn the check off")


@dataclass(frozen=True)
class ProbeGap:
    """The largest |engine - learner| log-prob over the probe's response tokens, and where it is."""

    max_gap: float
    mean_gap: float
    sequence: int
    token: int


def _gap(a: float, b: float) -> float:
    gap = abs(a - b)
    return gap if gap == gap else float("inf")


def probe_gap(engine: list[list[float]], learner: list[list[float]]) -> ProbeGap:
    """Compare the engine's and the learner's log-probs of the probe's response tokens, row by row."""
    if [len(r) for r in engine] != [len(r) for r in learner]:
        raise ValueError(f"the engine scored {[len(r) for r in engine]} probe tokens per sequence but the learner "
                         f"{[len(r) for r in learner]}: the two sides built different probes")
    # a NaN on either side counts as an infinite gap: it must fail the check, and NaN never compares greater
    gaps = [(_gap(a, b), i, j) for i, (engine_row, learner_row) in enumerate(zip(engine, learner))
            for j, (a, b) in enumerate(zip(engine_row, learner_row))]
    if not gaps:
        raise ValueError("the weight-sync probe has no response tokens; weight_sync.verify_response_tokens >= 1")
    worst = max(gaps)
    return ProbeGap(max_gap=worst[0], mean_gap=sum(g for g, _, _ in gaps) / len(gaps), sequence=worst[1],
                    token=worst[2])


def run_probe(cfg, vocab_size: int) -> WeightProbe:
    """The probe of a run (`cfg`: its RunConfig): the same on the driver and on every rollout worker."""
    ws = cfg.weight_sync
    return build_weight_probe(vocab_size, ws.verify_sequences, ws.verify_prompt_tokens, ws.verify_response_tokens,
                              cfg.train.seed)
