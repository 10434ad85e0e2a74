"""The built-in verifiers' specs, imported once by rewards/registry.py on first use. Add new verifier modules here;
a verifier module defines `SPEC` and imports nothing that imports it (not the registry, not the scorer)."""

from rewards import arithmetic, code_sandbox, gsm8k, longcot, math_answer, task_library
from rewards.spec import VerifierSpec

BUILTIN_SPECS: tuple[VerifierSpec, ...] = (arithmetic.SPEC, code_sandbox.SPEC, gsm8k.SPEC, longcot.SPEC, math_answer.SPEC,
                                          task_library.SPEC)
