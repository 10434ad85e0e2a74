"""A trained rank's checkpoint and state methods, the policy's and the critic's alike: its part of a DeepSpeed
checkpoint (weights, optimizer partition, learning-rate schedule, the rank's own counters), its RNG states, and
the readings tests and resumes compare (the optimizer digest, a bitwise snapshot).

The rank template (learner/rank_template.py) mixes this in, so these stay remote methods of the rank; the
checkpoint's layout belongs to cluster/checkpoint.py. Each method needs only the rank's built engine: DeepSpeed's
own save and load are engine methods, so this module does not import DeepSpeed.
"""

import os

import torch

from learner.rng_state import capture_rng_state, restore_rng_state

DS_TAG = "ds"
"""The DeepSpeed checkpoint tag inside a checkpoint's learner/ folder."""


class RankCheckpoint:
    """Needs `self.engine` (the DeepSpeed engine), `self.rank` and `self.role`. A rank with counters of its own to
    resume (the critic's version) overrides client_state and restore_client_state."""

    lora = False
    """A rank that trains a LoRA adapter (model.lora): its checkpoint holds the adapter and its optimizer state,
    not the frozen base model, which comes from model.path again on resume."""

    def client_state(self) -> dict:
        """The rank's own state saved inside its DeepSpeed checkpoint; none for the policy's ranks."""
        return {}

    def restore_client_state(self, state: dict) -> None:
        """Take back what client_state saved."""

    def save_state(self, folder: str) -> dict:
        """Write this rank's part of a DeepSpeed checkpoint (weights, its optimizer partition, client_state())
        under `folder`/ds and its RNG states to `folder`/rng_rank{r}.pt. Collective: every rank calls it together.
        Returns optimizer_digest() as saved, with client_state()."""
        self.engine.save_checkpoint(folder, tag=DS_TAG, save_latest=False, client_state=self.client_state(),
                                    exclude_frozen_parameters=self.lora)
        torch.save(capture_rng_state(), os.path.join(folder, f"rng_rank{self.rank}.pt"))
        return {**self.optimizer_digest(), **self.client_state()}

    def load_state(self, folder: str) -> dict:
        """Load what save_state wrote (weights, optimizer state, learning-rate schedule, client state, RNG
        states). Collective. Returns optimizer_digest() as loaded, with client_state(), so the caller can compare
        it with the saved one."""
        path, client = self.engine.load_checkpoint(folder, tag=DS_TAG, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True, load_module_strict=not self.lora)
        if path is None:
            raise RuntimeError(f"{self.role} rank {self.rank}: DeepSpeed found no checkpoint `{DS_TAG}` in {folder}")
        self.restore_client_state(client)
        restore_rng_state(torch.load(os.path.join(folder, f"rng_rank{self.rank}.pt"), weights_only=False))
        return {**self.optimizer_digest(), **self.client_state()}

    def optimizer_digest(self) -> dict:
        """Adam's step count and the sums of its moments over this rank's optimizer partition (float64): equal
        before a save and after the load when the optimizer state came back whole."""
        base = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)  # ZeRO wraps the torch one
        steps, exp_avg, exp_avg_sq = [], 0.0, 0.0
        for state in base.state.values():
            if "step" in state:
                steps.append(float(state["step"]))
            if "exp_avg" in state:
                exp_avg += float(state["exp_avg"].double().abs().sum())
                exp_avg_sq += float(state["exp_avg_sq"].double().sum())
        return {"rank": self.rank, "step": max(steps, default=0.0), "exp_avg_abs_sum": exp_avg,
                "exp_avg_sq_sum": exp_avg_sq}

    def state_snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of this rank's weights (its partition under ZeRO-3) and its optimizer's tensors (fp32 master
        partitions, Adam moments, step counts), by name: tests compare two of them bitwise (a skipped update)."""
        out = {}
        for name, param in self.engine.module.named_parameters():
            out[f"param/{name}"] = getattr(param, "ds_tensor", param).detach().clone()
        zero = self.engine.optimizer
        # fp32 master partitions: ZeRO-1/2 and ZeRO-3 name them differently
        masters = (getattr(zero, "single_partition_of_fp32_groups", None)
                   or getattr(zero, "fp32_partitioned_groups_flat", []))
        for g, master in enumerate(masters):
            out[f"master/{g}"] = master.detach().clone()
        # the torch optimizer's state (ZeRO-3 empties its param_groups between steps, so walk the state itself)
        inner = getattr(zero, "optimizer", zero)
        for i, state in enumerate(inner.state.values()):
            for key, value in state.items():
                out[f"state/{i}/{key}"] = value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
        return out
