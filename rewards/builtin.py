"""Imports every built-in verifier module so their registrations run. Add new verifier modules here."""

from rewards import arithmetic, code_sandbox, gsm8k, math_answer  # noqa: F401
