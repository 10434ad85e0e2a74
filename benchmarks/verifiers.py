"""Verifier throughput and sandbox overhead, measured in one run (machine time is noisy: compare rows of the
same run). Prints samples per second of the GSM8K and math verifiers through the Scorer with 1 and 2
processes (plus in-process, no pool), and the code sandbox's cost per execution against a bare subprocess.

    python benchmarks/verifiers.py [--gsm8k PATH] [--samples N] [--runs N]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from protocols.reward import CodeSandboxConfig, RewardConfig
from protocols.trajectory import Prompt
from rewards.code_sandbox import run_in_sandbox
from rewards.registry import resolve_verifier
from rewards.scorer import Scorer

MATH_PAIRS = [
    (r"\frac{1}{2}", r"\boxed{0.5}"), (r"2\sqrt{2}", r"\boxed{\sqrt{8}}"), (r"[1, 3)", r"\boxed{[1,3)}"),
    (r"\{1,2,3\}", r"\boxed{\{3,2,1\}}"), (r"50\%", r"\boxed{50}"), (r"x = 3", r"\boxed{3}"),
    (r"\text{Monday}", r"\boxed{\text{Tuesday}}"), (r"2\pi", r"\boxed{\pi}"),
]  # fmt: skip
PROGRAM = "print(int(input()) * 2)"


def gsm8k_samples(path: Path, n: int) -> tuple[list[Prompt], list[str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    prompts = [Prompt(prompt_id=f"gsm8k/test/{i}", prompt_token_ids=[0], answer=r["answer"]) for i, r in enumerate(rows)]
    # Half the responses are the row's own solution, half the next row's.
    responses = [rows[i if i % 2 == 0 else (i + 1) % len(rows)]["answer"] for i in range(len(rows))]
    return prompts, responses


def math_samples(n: int) -> tuple[list[Prompt], list[str]]:
    pairs = [MATH_PAIRS[i % len(MATH_PAIRS)] for i in range(n)]
    # A distinct prefix per sample keeps any caching from flattering the figures.
    return ([Prompt(prompt_id=f"math/{i}", prompt_token_ids=[0], answer=g) for i, (g, _) in enumerate(pairs)],
            [f"Step {i}: so the answer is {r}" for i, (_, r) in enumerate(pairs)])


def in_process_rate(verifier: str, prompts: list[Prompt], responses: list[str]) -> float:
    fn = resolve_verifier(verifier).fn
    start = time.perf_counter()
    for p, r in zip(prompts, responses, strict=True):
        fn(p, r)
    return len(prompts) / (time.perf_counter() - start)


def scorer_rate(verifier: str, processes: int, prompts: list[Prompt], responses: list[str]) -> float:
    scorer = Scorer(RewardConfig(verifier=verifier, num_processes=processes, timeout_s=30))
    try:
        scorer.score(prompts[:8], responses[:8])  # waits for the processes to start
        start = time.perf_counter()
        results = scorer.score(prompts, responses)
        elapsed = time.perf_counter() - start
        assert not any(r.error for r in results), [r.error for r in results if r.error][:3]
        return len(prompts) / elapsed
    finally:
        scorer.close()


def sandbox_overhead_ms(runs: int) -> tuple[float, float]:
    cfg = CodeSandboxConfig()
    bare, boxed = [], []
    for _ in range(runs):  # interleaved, so drift in machine load hits both alike
        start = time.perf_counter()
        out = subprocess.run([sys.executable, "-I", "-S", "-c", PROGRAM], input="21", capture_output=True, text=True)
        bare.append(time.perf_counter() - start)
        assert out.stdout == "42\n"
        start = time.perf_counter()
        run = run_in_sandbox(PROGRAM, cfg, stdin="21")
        boxed.append(time.perf_counter() - start)
        assert run.status == "ok" and run.stdout == "42\n", run
    return 1000 * statistics.median(bare), 1000 * statistics.median(boxed)


def main() -> None:
    shared = os.environ.get("RELAYRL_SHARED_DIR")
    default = (Path(shared) if shared else Path(__file__).resolve().parents[2] / "shared") / "data/gsm8k/test.jsonl"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", type=Path, default=default)
    parser.add_argument("--samples", type=int, default=1319, help="GSM8K samples (math uses a quarter of it)")
    parser.add_argument("--runs", type=int, default=30, help="sandbox executions timed")
    args = parser.parse_args()

    workloads = {"gsm8k": gsm8k_samples(args.gsm8k, args.samples), "math": math_samples(max(8, args.samples // 4))}
    print(f"{'verifier':<8} {'samples':>7} {'in-process/s':>13} {'1 process/s':>12} {'2 processes/s':>14}")
    for name, (prompts, responses) in workloads.items():
        rates = [in_process_rate(name, prompts, responses)] + [scorer_rate(name, k, prompts, responses) for k in (1, 2)]
        print(f"{name:<8} {len(prompts):>7} {rates[0]:>13,.0f} {rates[1]:>12,.0f} {rates[2]:>14,.0f}")
    bare, boxed = sandbox_overhead_ms(args.runs)
    print(f"\ncode sandbox, median of {args.runs} runs of `{PROGRAM}`:")
    print(f"  bare subprocess {bare:6.1f} ms   sandbox {boxed:6.1f} ms   overhead {boxed - bare:6.1f} ms per execution")


if __name__ == "__main__":
    main()
