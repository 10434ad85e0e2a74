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
from rewards import sandbox_cgroup
from rewards.code_sandbox import run_in_sandbox
from rewards.registry import resolve_verifier
from rewards.scorer import Scorer

# (gold, response) templates; `{i}` varies per sample so no parse is ever served from a cache.
MATH_TEMPLATES = [
    (r"\frac{{1}}{{{i}}}", r"\boxed{{\dfrac{{1}}{{{i}}}}}"), (r"{i}\sqrt{{2}}", r"\boxed{{\sqrt{{{i2}}}}}"),
    (r"[{i}, {j})", r"\boxed{{[{i},{j})}}"), (r"\{{{i},{j}\}}", r"\boxed{{\{{{j},{i}\}}}}"),
    (r"{i}\%", r"\boxed{{{i}}}"), (r"x = {i}", r"\boxed{{{i}}}"),
    (r"\text{{Monday{i}}}", r"\boxed{{\text{{Tuesday{i}}}}}"), (r"{i}\pi", r"\boxed{{{j}\pi}}"),
]  # fmt: skip
PROGRAM = "print(int(input()) * 2)"


def gsm8k_samples(path: Path, n: int) -> tuple[list[Prompt], list[str]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    prompts = [Prompt(prompt_id=f"gsm8k/test/{i}", prompt_token_ids=[0], answer=r["answer"]) for i, r in enumerate(rows)]
    # Half the responses are the row's own solution, half the next row's.
    responses = [rows[i if i % 2 == 0 else (i + 1) % len(rows)]["answer"] for i in range(len(rows))]
    return prompts, responses


def math_samples(n: int) -> tuple[list[Prompt], list[str]]:
    prompts, responses = [], []
    for k in range(n):
        gold, response = MATH_TEMPLATES[k % len(MATH_TEMPLATES)]
        values = {"i": k + 2, "j": k + 3, "i2": 2 * (k + 2) ** 2}  # sqrt(2 i^2) = i sqrt(2)
        prompts.append(Prompt(prompt_id=f"math/{k}", prompt_token_ids=[0], answer=gold.format(**values)))
        responses.append("So the answer is " + response.format(**values))
    return prompts, responses


def in_process_rate(verifier: str, prompts: list[Prompt], responses: list[str]) -> float:
    fn = resolve_verifier(verifier).fn
    for p, r in zip(prompts[:8], responses[:8], strict=True):
        fn(p, r)  # first calls pay for lazy imports
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
    print(f"  memory limit of the process tree: {sandbox_cgroup.scope()}")


if __name__ == "__main__":
    main()
