"""What a verifier is: its name in YAML (`reward.verifier: gsm8k`), its scoring function, and the hook that
hands it the run's `reward.*` settings. Verifier modules build one `VerifierSpec` each; rewards/registry.py
collects them, and the scorer's pool processes call every spec's `configure` before scoring.
"""

from collections.abc import Callable
from dataclasses import dataclass

from protocols.reward import RewardConfig


@dataclass(frozen=True)
class VerifierSpec:
    name: str
    fn: Callable
    """`fn(prompt, response_text) -> VerifierResult | float`, or with `batched` the same over lists. The text is
    the model's final answer: in a tool-using sample, what follows the last tool output (Trajectory.final_text)."""
    batched: bool = False
    configure: Callable[[RewardConfig], None] | None = None
    """Called with the run's `reward` settings in each scorer process before any sample is scored (the code
    verifier's sandbox limits, gsm8k's extraction mode); None when the verifier has no settings."""
    wants_tool_calls: bool = False
    """`fn` also takes `tool_calls=`: the sample's tool calls (`list[ToolCall]`, empty for a single-turn
    response), or with `batched` one such list per response. Without it a verifier sees only the final answer."""
