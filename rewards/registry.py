"""Verifier registry: maps a name used in YAML (`reward.verifier: gsm8k`) to a `VerifierSpec` (rewards/spec.py).

A verifier has the signature `fn(prompt: Prompt, response_text: str) -> VerifierResult` (single form) or,
registered with `batched=True`, `fn(prompts: list[Prompt], responses: list[str]) -> list[VerifierResult]`.
The built-in specs come from rewards/builtin.py, imported on first use; user verifiers are registered with
`register_verifier` or loaded by import path `module:function` (see `resolve_verifier`). Verifier modules never
import this module, so the imports run one way: registry -> builtin -> verifiers -> spec.
"""

import importlib
from collections.abc import Callable

from protocols.reward import RewardConfig
from rewards.spec import VerifierSpec

_REGISTRY: dict[str, VerifierSpec] = {}
_builtins_loaded = False


def _add(spec: VerifierSpec) -> None:
    if spec.name in _REGISTRY and _REGISTRY[spec.name].fn is not spec.fn:
        raise ValueError(
            f"verifier name {spec.name!r} is already registered by {_REGISTRY[spec.name].fn!r}; pick another name"
        )
    _REGISTRY[spec.name] = spec


def register_verifier(
    name: str, batched: bool = False, configure: Callable[[RewardConfig], None] | None = None,
    wants_tool_calls: bool = False,
) -> Callable[[Callable], Callable]:
    """Decorator: `@register_verifier("mine")` makes the function usable as `reward.verifier: mine`; `configure`
    receives the run's `reward` settings in each scorer process before scoring; `wants_tool_calls` hands the
    function each sample's tool calls as `tool_calls=` (rewards/spec.py)."""

    def wrap(fn: Callable) -> Callable:
        _add(VerifierSpec(name=name, fn=fn, batched=batched, configure=configure, wants_tool_calls=wants_tool_calls))
        return fn

    return wrap


def _import_builtins() -> None:
    # Imported on first use, not at module level: the math verifier pulls in sympy, which the driver's
    # config checks do not need.
    global _builtins_loaded
    if _builtins_loaded:
        return
    from rewards.builtin import BUILTIN_SPECS

    for spec in BUILTIN_SPECS:
        _add(spec)
    _builtins_loaded = True


def resolve_verifier(name: str) -> VerifierSpec:
    """Return the verifier registered as `name`, or import `module:function` (single form unless the function
    has an attribute `batched = True`; given the tool calls when it has `wants_tool_calls = True`)."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(
                f"reward.verifier={name!r} could not be imported ({err}); give `module:function` with the module "
                f"on PYTHONPATH, or a registered name: {sorted(_REGISTRY)}"
            ) from err
        return VerifierSpec(name=name, fn=fn, batched=bool(getattr(fn, "batched", False)),
                            wants_tool_calls=bool(getattr(fn, "wants_tool_calls", False)))
    _import_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"reward.verifier={name!r} is not registered; use one of {sorted(_REGISTRY)} or `module:function`")
    return _REGISTRY[name]


def registered_names() -> list[str]:
    _import_builtins()
    return sorted(_REGISTRY)


def configure_verifiers(cfg: RewardConfig) -> None:
    """Hand `cfg` to the `configure` hook of every registered verifier, so a prompt that names another
    verifier than `reward.verifier` is scored with the same settings. The scorer calls it in each pool process."""
    _import_builtins()
    for spec in list(_REGISTRY.values()):
        if spec.configure is not None:
            spec.configure(cfg)
