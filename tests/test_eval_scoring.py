"""Held-out evaluation scores through real reward worker actors: their timeouts, each prompt's own verifier and
the run's `reward.*` settings apply; a verifier that hangs or raises, or a dead worker, counts as wrong and is
counted by kind, never raised."""

import pytest

from protocols.reward import CodeSandboxConfig, Gsm8kConfig, RewardConfig
from protocols.trajectory import Prompt


def raising_verifier(prompt: Prompt, response: str) -> float:
    raise RuntimeError("verifier bug")


def hanging_verifier(prompt: Prompt, response: str) -> float:
    import time

    time.sleep(60)
    return 1.0


def _prompt(i: int, answer: str = "", verifier: str = "", tests: list | None = None) -> Prompt:
    return Prompt(prompt_id=f"eval/{i}", prompt_token_ids=[0], answer=answer, verifier=verifier, tests=tests or [])


CFG = RewardConfig(
    verifier="math", num_processes=1, timeout_s=3.0,
    gsm8k=Gsm8kConfig(mode="strict"), code=CodeSandboxConfig(language_tags=["py"], run_timeout_s=2.0),
)  # fmt: skip
ECHO = [{"input": "4\n", "output": "8\n"}]
CASES = [
    # (prompt, response, counts as correct, error kind)
    (_prompt(0, r"\frac{1}{2}"), r"\boxed{0.5}", True, ""),
    # a verifier that hangs: stopped at reward.timeout_s, wrong
    (_prompt(1, "3", verifier="tests.test_eval_scoring:hanging_verifier"), "3", False, "timeout"),
    # the answer that once hung the driver's in-process verifier is refused at once by the math verifier's size
    # bound (rewards/math_answer.py MAX_ANSWER_DIGITS): wrong, no error
    (_prompt(7, "3"), r"\boxed{10^{10^{10}}}", False, ""),
    # a per-prompt verifier wins over reward.verifier (math would find no \boxed here)
    (_prompt(2, "5", verifier="gsm8k"), "#### 5", True, ""),
    # the run's reward.gsm8k.mode=strict: no "####", no answer (the driver's default, flexible, would take 5)
    (_prompt(3, "5", verifier="gsm8k"), "so 5", False, ""),
    # the run's reward.code.language_tags=[py]: a ```py block is the program, a ```python one is not
    (_prompt(4, verifier="code", tests=ECHO), "```py\nprint(int(input()) * 2)\n```", True, ""),
    (_prompt(5, verifier="code", tests=ECHO), "```python\nprint(int(input()) * 2)\n```", False, ""),
    # a verifier that raises: wrong, counted as an exception
    (_prompt(6, verifier="tests.test_eval_scoring:raising_verifier"), "anything", False, "exception"),
]


def _start(ray, n: int) -> list:
    from actors.reward_worker import RewardWorker

    return [ray.remote(RewardWorker).options(num_cpus=0).remote(CFG, i) for i in range(n)]


@pytest.mark.slow
def test_held_out_scoring_uses_the_run_settings_and_survives_failing_verifiers(ray_cluster):
    ray = ray_cluster
    from actors.reward_worker import score_on_workers

    workers = _start(ray, 2)
    try:
        prompts = [c[0] for c in CASES]
        correct, errors = score_on_workers(workers, prompts, [c[1] for c in CASES], CFG)
        assert correct == [c[2] for c in CASES]
        # one timeout (the hanging verifier) and one exception (the raising verifier)
        assert dict(errors) == {"timeout": 1, "exception": 1}
        # evaluation samples are not training data: the workers' reward_worker/* counters stay empty
        for metrics in ray.get([w.metrics.remote() for w in workers]):
            assert metrics["reward_worker/samples"] == 0
    finally:
        for w in workers:
            ray.kill(w)


@pytest.mark.slow
def test_held_out_scoring_counts_a_dead_worker_as_wrong(ray_cluster):
    ray = ray_cluster
    from actors.reward_worker import score_on_workers

    workers = _start(ray, 2)
    try:
        ray.get([w.ping.remote() for w in workers])
        ray.kill(workers[1])
        # 4 samples over 2 workers: 0 and 2 on the live one (correct), 1 and 3 on the dead one (wrong, counted)
        prompts = [_prompt(i, r"\frac{1}{2}") for i in range(4)]
        correct, errors = score_on_workers(workers, prompts, [r"\boxed{0.5}"] * 4, CFG)
        assert correct == [True, False, True, False]
        assert dict(errors) == {"worker_died": 2}
    finally:
        ray.kill(workers[0])
