"""Where a rollout worker sends each generated group to be scored, and what it sends again after a worker died.

A group goes to a reward worker (round robin over the live ones); beside the reward task, to one worker of every
token-scoring role that runs (reference, teacher: protocols.trajectory.TOKEN_SCORERS); with a critic (PPO), the
reward task's result is chained to a critic worker. That is the whole scoring path, built here once from the
lists the run gives. The controller (actors/controller.py) awaits those tasks and, in its `sync` reply, names the
groups whose reward, token-scoring or critic worker died, and hands over the live lists once the driver replaced
one (cluster/supervisor.py). This class keeps that routing and the retries; `RolloutWorker.run` drives it, and so do
the unit tests, with stand-in workers and stand-ins for `ray.put` and `ray.wait`.
"""

from typing import Any, Callable

from actors.controller_messages import SyncReply, SyncRequest
from actors.stream_join import StreamedGroup
from protocols.trajectory import TOKEN_SCORERS, TrajectoryGroup


def _ray_put(value: Any) -> Any:
    import ray

    return ray.put(value)


def _ray_wait(refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
    import ray

    # fetch_local=False: the controller resolves the refs, so the data goes reward worker -> controller directly
    return ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=False)


class ScoreRouter:
    """One worker's scoring tasks in flight and the live worker lists it sends to. Each list has a generation,
    so a `sync` reply that names a dead worker of an older list does not mark the index in the newer one."""

    def __init__(self, reward_workers: list, scorers: dict[str, list], critic_workers: list,
                 max_rescore_attempts: int, batch_timeout_s: float,
                 put: Callable[[Any], Any] = _ray_put, wait: Callable[..., tuple[list, list]] = _ray_wait) -> None:
        self.reward_workers = list(reward_workers)
        self.scorers = {role: list(workers) for role, workers in scorers.items() if workers}
        """Token-scoring role (TOKEN_SCORERS: reference, teacher) -> its live workers: every group also goes to one
        of each (round robin) for that model's per-token log-probs."""
        self.critic_workers = list(critic_workers)
        """PPO: critic workers stamp values on each scored group before it reaches the controller."""
        self.max_rescore_attempts = max_rescore_attempts
        self.batch_timeout_s = batch_timeout_s
        self._put, self._wait = put, wait
        self._reward_rr = self._critic_rr = 0
        self._scorer_rr: dict[str, int] = {}
        self.reward_generation = 0
        self.model_generation = 0
        """Generation of the token-scoring and critic lists (one counter for all, as the controller keeps it)."""
        self._dead_reward: set[int] = set()
        self._dead_scorer: dict[str, set[int]] = {}
        self._critic_dead = False
        """A critic worker of the current list died: the driver restarts the whole critic group, so groups wait
        for the new handles instead of meeting the old ranks."""
        self.scoring: dict = {}
        """reward (or critic) task ref -> group_id, until the task finished."""
        self.streamed: dict = {}
        """reward task ref -> StreamedGroup (token-scoring workers on)."""
        self.sent: dict[str, tuple[TrajectoryGroup, int, int, int]] = {}
        """group_id -> (group, reward worker index, re-scoring attempts, list generation) until the controller
        took its score."""
        self.sent_model: dict[str, tuple[dict[str, int], int]] = {}
        """group_id -> ({token-scoring role: worker index}, token-scoring/critic list generation) until the
        controller took its score."""
        self.unsent: list[tuple[TrajectoryGroup, int]] = []
        """(group, attempts) waiting for a live reward or token-scoring worker, or the restarted critic group."""
        self.counts = {"rescored": 0, "dropped_reward_worker_died": 0, "rescored_critic": 0,
                       "dropped_critic_failed": 0}
        for role in TOKEN_SCORERS:
            self.counts.update({f"rescored_{role}": 0, f"dropped_{role}_worker_died": 0})

    def _live(self, role: str) -> list[int]:
        dead = self._dead_scorer.get(role, set())
        return [i for i in range(len(self.scorers[role])) if i not in dead]

    def send(self, group: TrajectoryGroup, attempts: int = 0) -> None:
        """Round robin over the reward workers not known dead, and over each token-scoring role's; with none left
        in a role (or the critic group down) the group waits for the lists the driver sends after replacing them."""
        live = [i for i in range(len(self.reward_workers)) if i not in self._dead_reward]
        live_scorers = {role: self._live(role) for role in self.scorers}
        critic_down = bool(self.critic_workers) and self._critic_dead
        if not live or not all(live_scorers.values()) or critic_down:
            self.unsent.append((group, attempts))
            return
        index = live[self._reward_rr % len(live)]
        self._reward_rr += 1
        reward_input, token_scores = group, {}
        if self.scorers:
            # Token scores are computed beside the reward, not after it: one put, read by every task.
            reward_input = self._put(group)
            for role, indices in live_scorers.items():
                turn = self._scorer_rr.get(role, 0)
                self._scorer_rr[role] = turn + 1
                worker = indices[turn % len(indices)]
                token_scores[role] = (self.scorers[role][worker].score_group.remote(reward_input), worker)
        self.sent_model[group.group_id] = ({role: w for role, (_, w) in token_scores.items()}, self.model_generation)
        ref = self.reward_workers[index].score_group.remote(reward_input)
        if self.critic_workers:
            # Chained on the unresolved ref: the scored group goes reward worker -> critic -> controller.
            critic = self.critic_workers[self._critic_rr % len(self.critic_workers)]
            self._critic_rr += 1
            ref = critic.add_values.remote(ref)
        self.scoring[ref] = group.group_id
        if token_scores:
            self.streamed[ref] = StreamedGroup(ref, token_scores)
        self.sent[group.group_id] = (group, index, attempts, self.reward_generation)

    def stamp(self, request: SyncRequest) -> SyncRequest:
        """The list generations this worker sends to, on its `sync` request."""
        request.reward_generation = self.reward_generation
        request.model_generation = self.model_generation
        return request

    def on_reply(self, request: SyncRequest, reply: SyncReply) -> dict[str, list[str]]:
        """After a `sync`: take the live reward, token-scoring and critic lists if they changed, forget the groups
        the controller took, and send again the ones whose reward, token-scoring or critic worker died (at most
        `max_rescore_attempts` times). Returns the groups given up, by reason (`reward_worker_died`,
        `<role>_worker_died` for reference and teacher, `critic_failed`), for the worker to report as dropped."""
        news = False
        if reply.reward_workers is not None:
            self.reward_generation, self.reward_workers = reply.reward_workers[0], list(reply.reward_workers[1])
            self._dead_reward.clear()
            news = True
        if reply.model_workers is not None:
            self.model_generation, lists = reply.model_workers
            for role in TOKEN_SCORERS:
                if lists.get(role):
                    self.scorers[role] = list(lists[role])
            self.critic_workers = list(lists.get("critic", self.critic_workers))
            self._dead_scorer.clear()
            self._critic_dead = False
            news = True
        if news:
            unsent, self.unsent = self.unsent, []
            for group, attempts in unsent:
                self.send(group, attempts)
        roles = {**{g: "reward" for g in reply.rescore},
                 **{g: role for role, ids in reply.rescore_model.items() for g in ids},
                 **{g: "critic" for g in reply.rescore_critic}}
        dropped: dict[str, list[str]] = {}
        for group_id, _ in request.scored:
            entry = self.sent.pop(group_id, None)
            model_entry = self.sent_model.pop(group_id, None)
            role = roles.get(group_id)
            if entry is None or role is None:
                continue
            group, index, attempts, generation = entry
            if role == "reward" and generation == self.reward_generation:  # the index names the dead worker
                self._dead_reward.add(index)
            if role != "reward" and model_entry is not None and model_entry[1] == self.model_generation:
                if role == "critic":
                    self._critic_dead = True
                elif role in model_entry[0]:
                    self._dead_scorer.setdefault(role, set()).add(model_entry[0][role])
            reason = "critic_failed" if role == "critic" else f"{role}_worker_died"
            if attempts >= self.max_rescore_attempts:
                dropped.setdefault(reason, []).append(group_id)
                self.counts[f"dropped_{reason}"] += 1
            else:
                # a group whose token-scoring or critic worker died is sent whole again (every stage):
                # its reward result was not kept, and scoring it twice costs one verifier call
                self.counts["rescored" if role == "reward" else f"rescored_{role}"] += 1
                self.send(group, attempts + 1)
        return dropped

    def collect(self, block: bool = False) -> list[tuple[str, Any]]:
        """The scoring tasks that finished, as (group_id, task ref): the controller resolves them. With
        token-scoring workers a group is handed over (as a StreamedGroup) once every one of its tasks has
        finished, so the controller never waits on one. A failed task is counted by the controller. `block` (at
        stop) waits up to `batch_timeout_s` for the rest."""
        if not self.scoring:
            return []
        refs = [*self.scoring, *(task for item in self.streamed.values() for task in item.tasks())]
        ready, _ = self._wait(refs, len(refs), self.batch_timeout_s if block else 0)
        ready = set(ready)
        done = []
        for ref in [r for r in self.scoring if r in ready]:
            item = self.streamed.get(ref)
            if item is not None and not all(task in ready for task in item.tasks()):
                continue
            self.streamed.pop(ref, None)
            done.append((self.scoring.pop(ref), item or ref))
        return done

    def give_up(self) -> dict[str, list[str]]:
        """At stop, after a blocking `collect`: the groups still waiting for a live worker and those whose scoring
        did not end in time, by reason; the router forgets every group."""
        starved = [role for role in self.scorers if not self._live(role)]
        waiting_for = ("reward_worker_died" if len(self._dead_reward) == len(self.reward_workers) else
                       "critic_failed" if self._critic_dead else f"{(starved or ['reference'])[0]}_worker_died")
        dropped = {waiting_for: [g.group_id for g, _ in self.unsent], "reward_timeout": list(self.scoring.values())}
        self.unsent, self.scoring, self.streamed = [], {}, {}
        self.sent.clear()
        self.sent_model.clear()
        return {reason: ids for reason, ids in dropped.items() if ids}
