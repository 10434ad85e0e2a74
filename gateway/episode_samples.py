"""An episode's calls (gateway/episode.py) as training samples: the `Trajectory` records every rollout worker
produces, so a finished session takes the same road to the replay queue and the learner as a group does.

Calls form a tree: a call's parent is the call it extends. Each leaf gives one sample: the tokens along its path,
exactly as the engine saw and sampled them. The sample's prompt is the first untrained call's prompt; its response
is that call's sampled ids, then for each later call the tokens the endpoint inserted (a `ContextSpan`: log-prob
0, version -1, no loss) and that call's sampled ids. So an episode whose calls extend each other is ONE sample;
a split gives one sample per segment, sharing the reward; where two leaves share calls (a branch), the shared
calls train in the first leaf only and are prompt in the second. A retried call that nothing extended (the client
never used its reply) is an orphan: dropped and counted, so a retry never trains twice; so is a call whose reply
reached no client (it left or timed out) and that nothing extended.

An episode that ran over several weight versions may start with calls too stale to train (`min_version`: the
oldest version train.max_staleness still admits): the sample is cut at a call boundary, so its first trained call
is the first one whose sampled tokens are all recent enough, and the calls before it become prompt, exactly as
the engine saw them. Counted as `staleness_cuts` (calls cut)."""

from collections import Counter
from typing import Any

from gateway.episode import CallRecord
from protocols.trajectory import ContextSpan, Prompt, Trajectory, VerifierResult


def orphans(calls: list[CallRecord]) -> set[int]:
    """Calls retried by a later call (or a sibling retry that was extended) whose own reply nothing extended, and
    calls whose reply reached no client (undelivered) that nothing extended: the client never acted on them."""
    children = {c.plan.parent for c in calls if c.plan.parent is not None}
    slots: dict[int, list[int]] = {}
    for c in calls:
        slots.setdefault(c.index if c.plan.retry_of is None else c.plan.retry_of, []).append(c.index)
    delivered = {c.index for c in calls if c.delivered}
    out = {c.index for c in calls if c.index not in delivered and c.index not in children}
    for members in slots.values():
        if len(members) < 2:
            continue
        extended = [i for i in members if i in children]
        seen = [i for i in members if i in delivered]
        keep = extended[-1] if extended else (seen or members)[-1]
        out |= {i for i in members if i != keep and i not in children}
    return out


def episode_samples(calls: list[CallRecord], episode_id: str, group_id: str, reward: float,
                    info: dict[str, Any] | None = None, first_index: int = 0, worker_id: int = 0,
                    tokenizer: Any = None, correct: bool = False,
                    min_version: int | None = None) -> tuple[list[Trajectory], Counter]:
    """The samples of an episode, in the order of their leaves, with `sample_index` from `first_index`, and the
    counts: samples, retry_orphans, calls_undelivered,
    staleness_cuts. `tokenizer` (optional) decodes each sample's text for logs;
    `min_version` (optional) cuts each sample after its calls that sampled a token older than it."""
    dropped = orphans(calls)
    undelivered = sum(1 for c in calls if c.index in dropped and not c.delivered)
    live = [c for c in calls if c.index not in dropped]
    by_index = {c.index: c for c in live}
    parents = {c.plan.parent for c in live}
    leaves = [c for c in live if c.index not in parents]
    trained: set[int] = set()
    samples = []
    cuts = 0
    for leaf in leaves:
        path = [leaf]
        while path[-1].plan.parent is not None:
            path.append(by_index[path[-1].plan.parent])
        path.reverse()
        first = next(k for k, c in enumerate(path) if c.index not in trained)
        if min_version is not None:
            # the last stale call ends the cut (the leaf itself is kept: past the bound, the queue drops it, counted)
            stale = [k for k in range(first, len(path) - 1) if min(path[k].token_versions, default=min_version)
                     < min_version]
            if stale:
                cuts += stale[-1] + 1 - first
                first = stale[-1] + 1
        samples.append(_sample(path[first:], episode_id, group_id, first_index + len(samples), reward, info or {},
                               worker_id, tokenizer, correct))
        trained |= {c.index for c in path}
    return samples, Counter({"samples": len(samples), "retry_orphans": len(dropped) - undelivered,
                             "calls_undelivered": undelivered, "staleness_cuts": cuts})


def _sample(path: list[CallRecord], episode_id: str, group_id: str, index: int, reward: float,
            info: dict[str, Any], worker_id: int, tokenizer: Any, correct: bool) -> Trajectory:
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    spans: list[ContextSpan] = []
    for previous, call in zip([None, *path], path):
        if previous is not None:
            seen = previous.ids
            if call.plan.prompt_ids[: len(seen)] != seen:
                raise ValueError(f"episode {episode_id}: call {call.index}'s prompt does not start with call "
                                 f"{previous.index}'s ids; a joined call must extend its parent exactly")
            inserted = call.plan.prompt_ids[len(seen):]
            if inserted:
                spans.append(ContextSpan(start=len(ids), tokens=len(inserted)))
                ids += inserted
                logprobs += [0.0] * len(inserted)
                versions += [-1] * len(inserted)
        ids += call.sampled_ids
        logprobs += call.behavior_logprobs
        versions += call.token_versions
    prompt_ids = path[0].plan.prompt_ids
    decode = (lambda t: tokenizer.decode(t, skip_special_tokens=False)) if tokenizer is not None else (lambda t: "")
    prompt = Prompt(prompt_id=f"{episode_id}/{index}", prompt_token_ids=prompt_ids, prompt_text=decode(prompt_ids),
                    metadata={"episode": episode_id, "calls": [c.index for c in path],
                              "split_reason": path[0].plan.split_reason or ""})
    return Trajectory(group_id=group_id, sample_index=index, prompt=prompt, response_token_ids=ids,
                      behavior_logprobs=logprobs, token_versions=versions, finish_reason=path[-1].finish_reason,
                      response_text=decode(ids), context_spans=spans or None, reward=reward,
                      result=VerifierResult(reward=reward, correct=correct, info=info), worker_id=worker_id)
