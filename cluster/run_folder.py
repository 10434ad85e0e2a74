"""The run folder: resolved config, metrics.jsonl, TensorBoard events, checkpoints, final model, summary.json.

With `logging.wandb` the same metrics also go to a Weights & Biases run carrying the resolved config. What a
metrics line holds, and the names in it, are protocols/metrics.py's; this file only writes them.
"""

import json
import logging
import os
from pathlib import Path

from protocols.config import RunConfig, dump_config
from protocols.metrics import SECTIONS, log_record, scalars, unknown_names

log = logging.getLogger(__name__)


class RunFolder:
    def __init__(self, cfg: RunConfig, resume_step: int | None = None) -> None:
        """`resume_step`: a resumed run appends to the folder's logs after dropping what was logged past the
        checkpoint's step (those steps are trained again), so every step appears once."""
        self.path = Path(cfg.output_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(dump_config(cfg))
        if resume_step is not None:
            self._truncate_metrics(resume_step)
        self._metrics = open(self.path / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events at or past it that an earlier, interrupted writer left
            self._tb = SummaryWriter(str(self.path / "tensorboard"),
                                     purge_step=None if resume_step is None else resume_step + 1)
        except ImportError:
            # TensorBoard is a declared dependency; without it the run still logs metrics.jsonl.
            self._tb = None
        self._wandb = open_wandb(cfg, self.path) if cfg.logging.wandb else None
        self._warned: set[str] = set()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        unknown = [name for name in unknown_names(metrics) if name not in self._warned]
        if unknown:
            # written anyway; the warning asks for the section to be documented in protocols/metrics.py
            self._warned.update(unknown)
            log.warning("metrics %s are in no section of protocols/metrics.py SECTIONS (%s)", unknown,
                        ", ".join(SECTIONS))
        self._metrics.write(log_record(step, metrics) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            # one event holding every scalar of the step: an event per scalar (its writer thread appends each to
            # the file) cost the driver 23 ms of CPU a step at 80 metrics, against 1.6
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=key, simple_value=value) for key, value in scalars(metrics).items()]
            self._tb._get_file_writer().add_summary(Summary(value=values), step)
        if self._wandb is not None:
            self._wandb.log(scalars(metrics), step=step)

    def _truncate_metrics(self, last_step: int) -> None:
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return
        # a line cut short by a kill is dropped too
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= last_step:
                    kept.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))
        if self._wandb is not None:
            self._wandb.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})

    @property
    def final_model_dir(self) -> str:
        return str(self.path / "final_model")

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def open_wandb(cfg: RunConfig, folder: Path):
    """A W&B run with the resolved config attached. Its files go under $WANDB_DIR when set, else the run
    folder (offline runs land in `<folder>/wandb/offline-run-*`, for `wandb sync`)."""
    import wandb

    settings = cfg.logging
    run = wandb.init(
        project=settings.wandb_project,
        entity=settings.wandb_entity or None,
        name=settings.wandb_name or folder.resolve().name,
        mode=os.environ.get("WANDB_MODE", settings.wandb_mode),
        dir=os.environ.get("WANDB_DIR") or str(folder),
        config=cfg.model_dump(mode="json"),
    )
    # The YAML itself too (W&B uploads what lies in run.dir), so `relayrl train --config` can re-run it as is;
    # not named config.yaml, which is W&B's own file there.
    Path(run.dir, "relayrl_config.yaml").write_text(dump_config(cfg))
    return run
