"""The cache of built demo models: one folder per cache key under `$RELAYRL_CACHE_DIR` (default
`~/.cache/relayrl/demo_models`), built once and reused after. Each demo computes its own key from every setting that
changes its model (demos/arithmetic_model.py `demo_model_key`, demos/longcot_model.py `longcot_model_key`).
"""

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

READY_MARKER = "relayrl_ready.json"
"""Written last into a cached model folder; a folder without it is never reused."""


def default_cache_dir() -> Path:
    """`$RELAYRL_CACHE_DIR` if set, else `~/.cache/relayrl/demo_models`."""
    env = os.environ.get("RELAYRL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "relayrl" / "demo_models"


def build_cached(cache: Path, key: str, build: Callable[[Path], dict[str, Any]]) -> str:
    """`cache/key`, built by `build(folder)` the first time (it returns the stats written into the ready marker,
    to which the build's wall seconds are added) and reused after. The build runs in a temporary folder renamed
    into place with the marker inside, so a crash or a concurrent builder never leaves a half-written folder that
    a later run would reuse."""
    final = cache / key
    if (final / READY_MARKER).is_file():
        return str(final)
    cache.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # A folder without the marker is from an older crashed build (ours are renamed in whole): replace it.
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".building-{final.name}-", dir=cache))
    threads = torch.get_num_threads()
    try:
        start = time.perf_counter()
        # One intra-op thread: the demo models' products are too small to share between threads, and on a
        # machine with other work (a 2-core one running tests, or Ray's actors) torch's spinning threads made
        # a warm-start step 6 to 8 times slower than one thread (0.9 s against 5.9 to 7.1 s a long-CoT step).
        torch.set_num_threads(1)
        stats = build(tmp)
        stats["warm_start/total_seconds"] = time.perf_counter() - start
        (tmp / READY_MARKER).write_text(json.dumps(stats, indent=2))
        try:
            tmp.rename(final)
        except OSError:
            # Another process finished the same build first; its folder is as good as ours.
            if not (final / READY_MARKER).is_file():
                raise
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def demo_model_stats(folder: str | Path) -> dict[str, Any]:
    """The warm-start record written into a prepared folder (losses, seconds, held-out greedy accuracy)."""
    return json.loads((Path(folder) / READY_MARKER).read_text())
