"""The maths core (learner/), the schemas (protocols/) and the weight transports (weights/) never import Ray, vLLM or
DeepSpeed when loaded: those live in cluster/ and actors/, DeepSpeed is imported inside the learner rank's methods
only, and Ray inside the transports' methods only. So the objective and the configs run in a plain torch process,
such as the GPU machine, which has neither Ray nor vLLM. Outside the rank actor (learner_actor.py), learner/ holds no
Ray at all, not even inside a method. The demo models (demos/) and the simulator (simulator/) load none of the three
either."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("ray", "vllm", "deepspeed")


def _modules(*folders: str) -> list[str]:
    return sorted(f"{p.parent.name}.{p.stem}" for folder in folders
                  for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")


def _loaded_after_import(modules: list[str]) -> list[str]:
    """The Ray, vLLM and DeepSpeed modules a fresh interpreter holds after importing `modules`."""
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}:\n"
             "    importlib.import_module(name)\n"
             f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_learner_and_protocols_load_without_ray_vllm_or_deepspeed():
    modules = _modules("learner", "protocols")
    assert "learner.objective" in modules and "protocols.config" in modules
    assert _loaded_after_import(modules) == []


def test_weights_load_without_ray_vllm_or_deepspeed():
    # the learner ranks import these, and so do the rollout workers: Ray only inside the methods that use it
    modules = _modules("weights")
    assert "weights.transport" in modules and "weights.backends" in modules
    assert _loaded_after_import(modules) == []


def test_demos_and_simulator_load_without_ray_vllm_or_deepspeed():
    # the demo models are built before the driver starts Ray (and by the dry run, which starts nothing); the
    # simulator runs hundreds of stand-in engines in one benchmark process
    modules = _modules("demos", "simulator")
    assert "demos.arithmetic_model" in modules and "simulator.simulation" in modules
    assert _loaded_after_import(modules) == []


def test_gateway_core_loads_without_ray_vllm_or_deepspeed():
    # the session endpoint's token contract and parsers are pure: its server alone meets the engines
    modules = ["gateway.chat_render", "gateway.episode", "gateway.episode_samples", "gateway.hermes",
               "gateway.sessions"]
    assert _loaded_after_import(modules) == []


def _imported_roots(tree: ast.AST) -> set[str]:
    """Top-level names a module's source imports anywhere: `import x`, `from x import y`, `__import__("x")`,
    `importlib.import_module("x")`, at module level or inside a function."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                roots.add(node.args[0].value.split(".")[0])
    return roots


def test_imported_roots_sees_imports_inside_functions():
    source = "def f():\n    import ray.util\n\ndef g():\n    from ray import get\n\nx = __import__('ray')\n"
    assert _imported_roots(ast.parse(source)) == {"ray"}


def test_no_learner_module_imports_ray_anywhere():
    """learner/ holds no Ray, in methods either: what needs Ray for the weights (the object store, the node's
    address for a weight group) lives in weights/. learner_actor.py, the rank actor itself, is the one exception
    the layer rule allows."""
    offenders = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "learner").rglob("*.py"))
                 if path.name != "learner_actor.py" and "ray" in _imported_roots(ast.parse(path.read_text()))]
    assert offenders == []
