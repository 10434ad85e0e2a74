"""The long chain-of-thought demo task's verifier: the text after the response's last `#` must be the product.

The working before it (rewards/longcot_data.py's `k:s+a=t;` steps) is never checked, right or wrong: only the
final answer earns the reward, as in RLVR on real reasoning tasks.
"""

from protocols.trajectory import Prompt, VerifierResult
from rewards.longcot_data import final_answer
from rewards.spec import VerifierSpec


def verify_longcot(prompt: Prompt, response_text: str) -> VerifierResult:
    """Reward 1 when the text after the last `#` (stripped) is exactly the gold product; 0 otherwise, and 0 when
    the response has no `#` (e.g. it was cut off at the length limit while still working)."""
    extracted = final_answer(response_text)
    correct = bool(extracted) and extracted == prompt.answer.strip()
    return VerifierResult(reward=1.0 if correct else 0.0, correct=correct, info={"extracted": extracted})


SPEC = VerifierSpec(name="longcot", fn=verify_longcot)
