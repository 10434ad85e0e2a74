"""Leases of the groups in flight: which rollout worker holds each admitted group, since when, and its prompt.

The controller (actors/controller.py) mixes this in. A lease starts when a group is granted and ends when the
group comes back scored or dropped. A lost worker's leases are released, so the admission window never
shrinks, and a late arrival of a released group is ignored. A checkpoint saves the leased groups' prompts, so a
resumed run re-issues them with the same group ids (so the same sampling seeds).
"""

from protocols.trajectory import Prompt


class LeaseBook:
    """The lease state and its bookkeeping; the controller decides when to grant, end and release."""

    def __init__(self) -> None:
        self.leases: dict[str, tuple[int, float]] = {}
        """group_id -> (worker_id, time admitted) for every group admitted and not yet back."""
        self.released: set[str] = set()
        self.lease_prompts: dict[str, Prompt] = {}
        """group_id -> its prompt, for every leased group: a checkpoint saves them so a resume re-issues them."""
        self.reissue: list[tuple[str, Prompt]] = []
        """Groups admitted before a resume and not back at the checkpoint: granted again, with the same group id
        (so the same sampling seeds), before any new prompt and outside the admission budget they already hold."""
        self.late_after_release = 0
        self.lost_workers: set[int] = set()
        """Rollout worker ids declared dead or drained out of the pool; they are granted nothing more (a replacement
        takes a new id)."""

    def _lease(self, group_id: str, prompt: Prompt, worker_id: int, now: float) -> None:
        self.leases[group_id] = (worker_id, now)
        self.lease_prompts[group_id] = prompt

    def _end_lease(self, group_id: str) -> bool:
        """False when the group's lease was released earlier (its worker was declared lost): ignore it."""
        if group_id in self.released:
            self.released.discard(group_id)
            self.late_after_release += 1
            return False
        self.leases.pop(group_id, None)
        self.lease_prompts.pop(group_id, None)
        return True

    def leases_of(self, worker_id: int) -> list[str]:
        return [g for g, (w, _) in self.leases.items() if w == worker_id]

    def _release_leases(self, worker_id: int) -> list[str]:
        """Retire a lost worker's id and end its leases as released; returns their group ids."""
        self.lost_workers.add(worker_id)
        group_ids = self.leases_of(worker_id)
        for group_id in group_ids:
            del self.leases[group_id]
            self.lease_prompts.pop(group_id, None)
        self.released.update(group_ids)
        return group_ids

    def _leases_state(self) -> dict:
        return {
            "released": sorted(self.released),
            # The groups in flight (leased, or waiting for re-issue after an earlier resume) with their prompts;
            # not their holders: a resumed run has new workers, and re-issues them all.
            "in_flight": [[g, p.model_dump(mode="json")] for g, p in
                          [*self.reissue, *((g, self.lease_prompts[g]) for g in self.leases)]],
        }

    def _load_leases_state(self, state: dict) -> None:
        self.released = set(state.get("released", []))
        # Every group leased at the checkpoint is re-issued (new leases at grant): its worker's progress was not
        # saved, and the same group id gives the same sampling seeds.
        self.reissue = [(g, Prompt.model_validate(p)) for g, p in state.get("in_flight", [])]
        self.leases, self.lease_prompts = {}, {}
