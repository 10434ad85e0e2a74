"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1).

From n samples of one prompt, c of them correct, the chance that at least one of k samples drawn without
replacement is correct: 1 - C(n-c, k) / C(n, k). The evaluation harness (cluster/evaluation.py) averages it
over prompts. Pure Python: the reward workers and the driver both import it.
"""

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k) for one prompt with n samples, c correct. Computed as the product
    1 - prod_{i=n-c+1}^{n} (1 - k / i), which never forms the binomials (they overflow floats near n = 1030)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: correct samples c={c} must be between 0 and the sample count n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be between 1 and the sample count n={n}; draw more samples")
    if n - c < k:
        return 1.0  # every draw of k samples contains a correct one
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_pass_at_k(counts: list[tuple[int, int]], k: int) -> float:
    """pass@k averaged over prompts, each given as (samples n, correct c); NaN for no prompts."""
    if not counts:
        return float("nan")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def powers_of_two_up_to(samples: int) -> list[int]:
    """The k reported for `samples` draws per prompt: 1, 2, 4, ... up to `samples` (and `samples` itself when
    it is not a power of two, so the largest k the samples allow is always reported)."""
    if samples < 1:
        return []
    ks = [1 << i for i in range(samples.bit_length()) if 1 << i <= samples]
    return ks if ks[-1] == samples else [*ks, samples]
