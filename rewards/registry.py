"""Verifier registry: maps a name used in YAML (`reward.verifier: gsm8k`) to a scoring function.

A verifier has the signature `fn(prompt: Prompt, response_text: str) -> VerifierResult` (single form) or,
registered with `batched=True`, `fn(prompts: list[Prompt], responses: list[str]) -> list[VerifierResult]`.
User verifiers are loaded by import path `module:function` (see `resolve_verifier`).
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from protocols.trajectory import Prompt, VerifierResult

SingleVerifier = Callable[[Prompt, str], VerifierResult]


@dataclass(frozen=True)
class VerifierSpec:
    name: str
    fn: Callable
    batched: bool = False


_REGISTRY: dict[str, VerifierSpec] = {}


def register_verifier(name: str, batched: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: `@register_verifier("gsm8k")` makes the function usable as `reward.verifier: gsm8k`."""

    def wrap(fn: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"verifier name {name!r} is already registered by {_REGISTRY[name].fn!r}; pick another name")
        _REGISTRY[name] = VerifierSpec(name=name, fn=fn, batched=batched)
        return fn

    return wrap


def _import_builtins() -> None:
    # Importing the modules runs their @register_verifier decorators.
    importlib.import_module("rewards.builtin")


def resolve_verifier(name: str) -> VerifierSpec:
    """Return the verifier registered as `name`, or import `module:function` (single form unless the function
    has an attribute `batched = True`)."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(
                f"reward.verifier={name!r} could not be imported ({err}); give `module:function` with the module "
                f"on PYTHONPATH, or a registered name: {sorted(_REGISTRY)}"
            ) from err
        return VerifierSpec(name=name, fn=fn, batched=bool(getattr(fn, "batched", False)))
    _import_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"reward.verifier={name!r} is not registered; use one of {sorted(_REGISTRY)} or `module:function`")
    return _REGISTRY[name]


def registered_names() -> list[str]:
    _import_builtins()
    return sorted(_REGISTRY)
