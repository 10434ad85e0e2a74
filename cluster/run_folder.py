"""The run folder: resolved config, metrics.jsonl, TensorBoard events, checkpoints, final model, summary.json."""

import json
import math
from pathlib import Path

from protocols.config import RunConfig, dump_config


class RunFolder:
    def __init__(self, cfg: RunConfig) -> None:
        self.path = Path(cfg.output_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(dump_config(cfg))
        self._metrics = open(self.path / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.path / "tensorboard"))
        except ImportError:
            # TensorBoard is a declared dependency; without it the run still logs metrics.jsonl.
            self._tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self._metrics.write(json.dumps({"step": step, **clean}) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if isinstance(value, float) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def write_summary(self, summary: dict) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    @property
    def final_model_dir(self) -> str:
        return str(self.path / "final_model")

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
