"""rewards/ imports run one way (registry -> builtin -> verifiers -> spec; datasets -> data generators), and the
scorer configures verifiers only through each spec's own `configure` hook, never by name."""

import ast
import subprocess
import sys
from pathlib import Path

from protocols.reward import CodeSandboxConfig, Gsm8kConfig, RewardConfig
from protocols.trajectory import Prompt
from rewards import code_sandbox, gsm8k, registry
from rewards.scorer import Scorer, setup_verifiers
from rewards.spec import VerifierSpec

ROOT = Path(__file__).resolve().parents[1]
REWARDS = ROOT / "rewards"
MODULES = sorted(p.stem for p in REWARDS.glob("*.py") if p.stem != "__init__")


def _imported_rewards_modules(name: str) -> set[str]:
    """The rewards modules that `rewards/<name>.py` imports anywhere in the file: at module level, inside
    functions, and by `importlib.import_module("rewards.x")` with a literal name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse((REWARDS / f"{name}.py").read_text())):
        dotted: list[str] = []
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "rewards":
            dotted = [f"rewards.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            dotted = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            dotted = [node.args[0].value]
        for module in dotted:
            parts = module.split(".")
            if parts[0] == "rewards" and len(parts) > 1 and parts[1] in MODULES:
                found.add(parts[1])
    found.discard(name)
    return found


GRAPH = {name: _imported_rewards_modules(name) for name in MODULES}


def _reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def _verifier_modules() -> set[str]:
    return GRAPH["builtin"] - {"spec"}


def test_the_graph_sees_the_known_edges():
    # A parser that found nothing would pass every test below, so check edges that must be there.
    assert "builtin" in GRAPH["registry"]
    assert {"arithmetic", "code_sandbox", "gsm8k", "math_answer"} <= GRAPH["builtin"]
    assert "arithmetic_data" in GRAPH["datasets"]


def test_rewards_imports_have_no_cycle():
    # Depth-first search; a module met again while still on the path closes a cycle.
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for nxt in sorted(GRAPH[name]):
            assert state.get(nxt) != "open", f"import cycle: {' -> '.join([*path, name, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, name])
        state[name] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [])


def test_data_loaders_reach_no_verifier():
    assert _verifier_modules() == {"arithmetic", "code_sandbox", "gsm8k", "longcot", "math_answer", "task_library"}
    for data_module in ("datasets", "arithmetic_data", "longcot_data", "task_library_data", "answer_formats"):
        assert not _reachable(data_module) & _verifier_modules(), data_module


def test_verifiers_never_import_what_imports_them():
    for verifier in _verifier_modules():
        assert not _reachable(verifier) & {"registry", "builtin", "scorer"}, verifier


def test_each_rewards_module_imports_alone_in_a_fresh_interpreter():
    # One interpreter per module, started together: a circle that only bites when a module is imported first
    # would fail here with a partially initialised module.
    procs = {name: subprocess.Popen([sys.executable, "-c", f"import rewards.{name}"], cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in MODULES}
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"import rewards.{name} failed:\n{stderr[-2000:]}"


def test_scorer_names_no_verifier():
    # Neither a verifier module nor a built-in verifier's name: settings reach verifiers through their hooks.
    text = (REWARDS / "scorer.py").read_text()
    assert not GRAPH["scorer"] & _verifier_modules()
    builtin_names = {f'"{name}"' for name in registry.registered_names()}
    for name in _verifier_modules() | builtin_names:
        assert name not in text, name


def test_the_scorer_calls_each_specs_configure_hook(monkeypatch):
    seen: list[RewardConfig] = []
    probe = VerifierSpec(name="probe", fn=lambda prompt, response: 1.0, configure=seen.append)
    monkeypatch.setitem(registry._REGISTRY, "probe", probe)
    cfg = RewardConfig(verifier="probe", timeout_s=3.0)
    setup_verifiers(cfg)
    assert seen == [cfg]


def test_builtin_hooks_set_gsm8k_mode_and_sandbox_limits():
    cfg = RewardConfig(verifier="arithmetic", timeout_s=20.0, gsm8k=Gsm8kConfig(mode="strict"),
                       code=CodeSandboxConfig(language_tags=["py"]))
    try:
        # Every registered verifier is configured, not only reward.verifier: a prompt may name another one.
        setup_verifiers(cfg)
        assert gsm8k._config.mode == "strict"
        assert code_sandbox._config.language_tags == ["py"]
        assert code_sandbox._sample_budget_s == 0.9 * 20.0  # tests stop at 90% of the per-sample timeout
    finally:
        setup_verifiers(RewardConfig())
    assert gsm8k._config.mode == "flexible" and code_sandbox._sample_budget_s == 9.0


def test_pool_processes_score_with_the_configured_gsm8k_mode():
    # "it is 18" has no `#### ` marker: flexible (the default) would take 18, strict finds no answer.
    scorer = Scorer(RewardConfig(verifier="gsm8k", num_processes=1, gsm8k=Gsm8kConfig(mode="strict")))
    prompts = [Prompt(prompt_id=f"g/test/{i}", prompt_token_ids=[0], answer="#### 18") for i in range(2)]
    try:
        assert [r.reward for r in scorer.score(prompts, ["#### 18", "it is 18"])] == [1.0, 0.0]
    finally:
        scorer.close()
