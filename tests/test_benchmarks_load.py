"""Every benchmark script loads and has a `main` (they run on demand and on a lent GPU, not in CI, so a refactor
that breaks one would otherwise surface only when someone needs its figure)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_benchmark_loads_and_has_a_main():
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
    assert len(names) >= 10 and "fault_injection" in names
    probe = ("import importlib\n"
             f"for name in {names!r}:\n"
             "    module = importlib.import_module('benchmarks.' + name)\n"
             "    assert callable(getattr(module, 'main', None)), name + ' has no main()'\n"
             f"print('loaded', {len(names)})\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith(f"loaded {len(names)}")
