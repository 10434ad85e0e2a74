"""The engine's side of the weight-sync check: after a rollout worker loads a checked version, the probe
(protocols/weight_probe.py) goes into the same engine as the rollouts, so it is scored in their decode steps.

`ProbingEngine` wraps the engine for the decode loop (actors/decode_loop.py): it forwards every call and keeps
the probe's outputs out of the loop. A finished probe becomes a result {version, digest, logprobs} that the
worker puts in its reports; the driver compares it with the learner's (weights/sync_check.py). A probe whose
weights change before it is scored (a newer version loaded meanwhile) is dropped, never compared.
"""

from collections import deque
from typing import Any

from protocols.weight_probe import WeightProbe

PREFIX = "weight-probe/"
"""Request ids of the probe start with this; the decode loop's never do (they start with a group id)."""

KEEP_RESULTS = 16
"""Results a worker keeps for its reports: the driver reads them every step, so a few versions suffice."""


def probe_params():
    """vLLM sampling parameters of a probe request."""
    from vllm import SamplingParams

    # prompt_logprobs come from the raw logits (temperature 1): the learner scores the probe the same way.
    # One sampled token is the least a request may ask for; it is not read.
    return SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)


class ProbingEngine:
    """The engine as the decode loop sees it, plus the probe's requests."""

    def __init__(self, engine: Any, probe: WeightProbe) -> None:
        self.engine = engine
        self.probe = probe
        self.pending: dict[str, list[float] | None] = {}
        """request id -> the sequence's response log-probs once scored, for the probe in flight."""
        self.pending_version: int | None = None
        self.results: deque[dict] = deque(maxlen=KEEP_RESULTS)
        self.dropped = 0
        """Probes dropped because the weights changed before they were scored."""

    # --- the probe ---------------------------------------------------------------------------------------------
    def start(self, version: int) -> None:
        """Score the probe under `version`, the weights just loaded. A probe of older weights still in flight is
        dropped: its result would mix two versions."""
        self.drop()
        params = probe_params()
        self.pending_version = version
        for i, (prompt, response) in enumerate(zip(self.probe.prompt_ids, self.probe.response_ids)):
            request_id = f"{PREFIX}{version}/{i}"
            self.pending[request_id] = None
            self.engine.add_request(request_id, {"prompt_token_ids": [*prompt, *response]}, params)

    def drop(self) -> None:
        if self.pending:
            self.engine.abort_request(list(self.pending))
            self.pending.clear()
            self.dropped += 1
        self.pending_version = None

    def finish(self) -> None:
        """Step the engine until the probe in flight is scored; only when no rollout is in the engine (between
        runs, or a worker with no groups), since their outputs would be lost."""
        while self.pending:
            for out in self.engine.step():
                self._take(out)

    def _take(self, out: Any) -> None:
        request_id = out.request_id
        if request_id not in self.pending or not out.finished:
            return  # an aborted probe's last output, or not scored yet
        i = int(request_id.rsplit("/", 1)[1])
        prompt, response = self.probe.prompt_ids[i], self.probe.response_ids[i]
        rows = out.prompt_logprobs[len(prompt): len(prompt) + len(response)]
        self.pending[request_id] = [row[token].logprob for row, token in zip(rows, response)]
        if all(v is not None for v in self.pending.values()):
            logprobs = [self.pending[f"{PREFIX}{self.pending_version}/{i}"] for i in range(len(self.pending))]
            self.results.append({"version": self.pending_version, "digest": self.probe.digest,
                                 "logprobs": logprobs})
            self.pending.clear()
            self.pending_version = None

    # --- the engine, for the decode loop -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: dict, params: Any) -> None:
        self.engine.add_request(request_id, prompt, params)

    def step(self) -> list:
        outputs = []
        for out in self.engine.step():
            if out.request_id.startswith(PREFIX):
                self._take(out)
            else:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
