"""The session endpoint's call inbox (gateway/engine_bridge.py): calls submitted from the server's thread start in
the decode loop at its next pump; the pump that closes a run completes and fails, but starts nothing (a call
started then would stay in the engine, where evaluation's offline `generate` would meet an output it did not ask
for)."""

import pytest

from gateway.engine_bridge import CallAborted, CallInbox


class StartedCalls:
    """The part of DecodeLoop a pump touches: the calls it holds and those that ended."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = {}
        self.finished_calls: list = []

    def start_call(self, call_id: str, prompt_ids: list[int], params) -> None:
        self.calls[call_id] = prompt_ids


def test_a_pump_starts_the_submitted_calls():
    inbox, decoding = CallInbox(lambda max_tokens, options: {"max_tokens": max_tokens}), StartedCalls()
    inbox.submit([1, 2], 4)
    inbox.submit([3], 4)
    assert inbox.in_flight == 2 and not decoding.calls
    inbox.pump(decoding)
    assert decoding.calls == {"gateway-call/1": [1, 2], "gateway-call/2": [3]}
    assert inbox.in_flight == 2


def test_the_closing_pump_fails_the_aborted_calls_and_starts_none():
    inbox, decoding = CallInbox(lambda max_tokens, options: None), StartedCalls()
    aborted = inbox.submit([1], 4)
    inbox.pump(decoding)
    decoding.calls.clear()  # the run ends: DecodeLoop.abort forgets every call
    waiting = inbox.submit([2], 4)
    inbox.pump(decoding, start_new=False)
    with pytest.raises(CallAborted):
        aborted.result(timeout=0)
    assert not decoding.calls and not waiting.done() and inbox.in_flight == 1
    inbox.pump(decoding)  # the next run's first pump
    assert list(decoding.calls) == ["gateway-call/2"]
