"""Which samples go to which rank and which micro-batch: pure functions over per-sample token counts.

Ranks get about equal token loads (Karmarkar-Karp largest differencing, as verl's seqlen_balancing does); within a
rank, samples fill micro-batches of about equal token counts under `learner.max_tokens_per_micro_batch`. Every
rank must run the same number of micro-batches (ZeRO reduces gradients inside backward, and ZeRO-3 gathers
parameters inside forward: both are collectives), so the count is the largest any rank needs.
"""

import heapq


def karmarkar_karp(weights: list[int], num_parts: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` split into `num_parts` parts of about equal sums (largest differencing method).

    equal_size: the parts' sizes differ by at most one (all len(weights) / num_parts when that divides). Parts
    come back sorted by index inside, and ordered by their first index, so the result does not depend on heap
    tie-breaking."""
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be >= 1")
    # A state is num_parts partial parts, each (sum, [indices]); sorted so parts[0] has the largest sum.
    heap: list = []
    if equal_size:
        # seed with groups of num_parts items, one per part, taken in sorted order (verl's scheme). A last, short
        # group leaves some of its parts empty: it is the only uneven state, and a merge pairs each part of one
        # state with one part of another, so the sizes stay at most one apart
        order = sorted(range(n), key=lambda i: weights[i])
        seeds = [order[k:k + num_parts] for k in range(0, n, num_parts)]
    else:
        seeds = [[i] for i in sorted(range(n), key=lambda i: weights[i])]
    for count, seed in enumerate(seeds):
        parts = [(weights[i], [i]) for i in seed] + [(0, []) for _ in range(num_parts - len(seed))]
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), count, parts))
    count = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # pair a's largest part with b's smallest, and so on: the difference shrinks
        merged = [(a[k][0] + b[num_parts - 1 - k][0], a[k][1] + b[num_parts - 1 - k][1]) for k in range(num_parts)]
        merged.sort(key=lambda p: -p[0])
        count += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), count, merged))
    parts = [sorted(idx) for _, idx in heap[0][2]] if heap else [[] for _ in range(num_parts)]
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def token_budget_micro_batches(tokens: list[int], budget: int, count: int = 0,
                               padded: bool = False) -> list[list[int]]:
    """Indices of one rank's samples grouped into micro-batches of at most `budget` tokens each, about equal.

    padded: the micro-batches will be padded rows, so a micro-batch costs rows x its longest sample; samples of
    similar lengths are then grouped together (longest first), which keeps the padding small.

    The number of micro-batches is the smallest that fits (trying from one per sample longer than the budget
    plus ceil(rest / budget) up), or `count` when that is larger (every rank must run the same number). A sample
    longer than the budget sits alone: never truncated. With more micro-batches than samples the extra ones are
    empty lists; the caller fills them with a masked dummy sample."""
    if budget < 1:
        raise ValueError(f"learner.max_tokens_per_micro_batch={budget} must be >= 1 here (0 selects sample-count "
                         "micro-batches before this function is reached)")
    n = len(tokens)
    if n == 0:
        return [[] for _ in range(count)]
    if padded:
        parts = _sorted_padded(tokens, budget)
        return _split_to(parts, tokens, count) if count > len(parts) else parts
    oversize = sum(t > budget for t in tokens)
    m = max(1, oversize + -(-sum(t for t in tokens if t <= budget) // budget))
    while True:
        parts = _first_fit_balanced(tokens, m, budget)
        if parts is not None:
            break
        m += 1
    if count > len(parts):
        more = _first_fit_balanced(tokens, count, budget) if count <= n else None
        parts = more if more is not None else _split_to(parts, tokens, count)
    return parts


def _first_fit_balanced(tokens: list[int], m: int, budget: int) -> list[list[int]] | None:
    """m non-empty bins (m <= len(tokens)): longest first into the lightest bin; None if a bin holding more than
    one sample would exceed the budget."""
    n = len(tokens)
    m = min(m, n)
    order = sorted(range(n), key=lambda i: -tokens[i])
    bins: list = [(0, k, []) for k in range(m)]
    heapq.heapify(bins)
    for i in order:
        load, k, idx = heapq.heappop(bins)
        if idx and load + tokens[i] > budget:
            return None
        heapq.heappush(bins, (load + tokens[i], k, idx + [i]))
    return sorted((sorted(idx) for _, _, idx in bins), key=lambda p: p[0])


def _sorted_padded(tokens: list[int], budget: int) -> list[list[int]]:
    """Longest first; a micro-batch takes the next sample while (rows + 1) x its longest stays in the budget."""
    parts: list[list[int]] = []
    for i in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        if parts and (len(parts[-1]) + 1) * tokens[parts[-1][0]] <= budget:
            parts[-1].append(i)
        else:
            parts.append([i])
    return sorted((sorted(p) for p in parts), key=lambda p: p[0])


def _split_to(parts: list[list[int]], tokens: list[int], count: int) -> list[list[int]]:
    """Split the heaviest multi-sample micro-batch in two until there are `count` (empty ones past one sample
    each). Splitting never breaks the budget."""
    parts = [list(p) for p in parts]
    while len(parts) < count:
        splittable = [p for p in parts if len(p) > 1]
        if not splittable:
            parts.append([])
            continue
        big = max(splittable, key=lambda p: sum(tokens[i] for i in p))
        parts.remove(big)
        halves = _first_fit_balanced([tokens[i] for i in big], 2, sum(tokens[i] for i in big))
        parts.extend([[big[j] for j in h] for h in halves])
    return sorted(parts, key=lambda p: (not p, p[0] if p else 0))


def check_fits_context(tokens: list[int], context: int | None) -> None:
    """Refuse a sample the model cannot hold at all (prompt + response beyond its context): upstream, prompts
    that would not fit are skipped and counted and max_prompt_tokens is lowered to fit, so one arriving here
    means the lengths were changed on the way."""
    if not context:
        return
    longest = max(tokens, default=0)
    if longest > context:
        i = tokens.index(longest)
        raise ValueError(
            f"sample {i} has {longest} tokens (prompt + response), more than the model's context of {context} "
            f"(max_position_embeddings): no learner.max_tokens_per_micro_batch can train it whole. Keep "
            f"data.max_prompt_tokens + rollout.max_response_tokens <= {context}")


def sample_count_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of micro_batch_size samples (the last may be smaller)."""
    return [list(range(i, min(i + micro_batch_size, num_samples))) for i in range(0, num_samples, micro_batch_size)]


def plan_ranks(tokens: list[int], num_ranks: int, budget: int) -> list[list[int]]:
    """Sample indices per rank, balanced by token count. With sample-count micro-batches (budget 0) every rank
    gets the same number of samples (one apart where num_ranks does not divide them: the critic's ranks take the
    whole batch, whatever its size), so the configured micro-batch count holds on every rank."""
    return karmarkar_karp(tokens, num_ranks, equal_size=budget == 0)


def micro_batch_count(tokens_per_rank: list[list[int]], budget: int, padded: bool = False) -> int:
    """The number of token-budget micro-batches every rank runs: the most any rank needs."""
    return max(len(token_budget_micro_batches(t, budget, padded=padded)) for t in tokens_per_rank) if tokens_per_rank else 0

