"""An OpenEnv-shaped environment for the products task (tools.environment: demos.products_env:ProductsEnv): the
model multiplies with a tool and submits its answer with another; the reward is set by the submission, so it
depends on the calls made, not on the final text. The shape TRL's `environment_factory` runs, and so does
relayrl's agent loop (rewards/environment.py)."""


class ProductsEnv:
    """One episode per sample: `reset` reads the gold product from the prompt's row."""

    def __init__(self) -> None:
        self.answer = ""
        self.reward = 0.0
        self.submitted = False

    def reset(self, answer: str = "", **row: object) -> None:
        """Start an episode: the gold answer is the row's `answer`; nothing is submitted yet."""
        self.answer = str(answer).strip()
        self.reward = 0.0
        self.submitted = False

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        return str(int(a) * int(b))

    def submit(self, answer: int) -> str:
        """Submit the final answer; only the first submission counts.

        Args:
            answer: The product, as an integer.
        """
        if self.submitted:
            return "already submitted"
        self.submitted = True
        self.reward = 1.0 if str(int(answer)) == self.answer else 0.0
        return "correct" if self.reward else "wrong"
