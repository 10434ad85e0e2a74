"""The maths core (learner/) and the schemas (protocols/) never import Ray, vLLM or DeepSpeed when loaded: those
live in cluster/ and actors/, and DeepSpeed is imported inside the learner rank's methods only. So the objective
and the configs run in a plain torch process, such as the GPU machine, which has neither Ray nor vLLM."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_learner_and_protocols_load_without_ray_vllm_or_deepspeed():
    modules = sorted(f"{p.parent.name}.{p.stem}" for folder in ("learner", "protocols")
                     for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")
    assert "learner.objective" in modules and "protocols.config" in modules
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'deepspeed')))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
