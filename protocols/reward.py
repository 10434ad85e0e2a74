"""Reward worker settings: which verifier scores responses, how many workers, the limits on each check,
the shaping terms composed with the task reward, and the code sandbox's limits.

Read by `rewards/scorer.py` (inside each reward worker) and by the verifiers its processes run.
"""

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ShapingConfig(BaseModel):
    """reward = task_weight * task + format_weight * format - length_penalty_weight * length_fraction.

    `VerifierResult.correct` always follows the task reward alone; the components land in `info`.
    """

    model_config = ConfigDict(extra="forbid")

    task_weight: float = Field(1.0, ge=0)
    """Weight of the verifier's own reward (0 to 1 for built-in verifiers). Keep 1 unless you rescale."""

    format_weight: float = Field(0.0, ge=0)
    """Weight of the format reward (1 when the response matches `format_regex`, else 0). 0 turns it off;
    0.1 to 0.2 is a common nudge towards a parseable answer."""

    format_regex: str = ""
    """Pattern a well-formed response contains (Python `re.search`, DOTALL), e.g. `\\\\boxed\\{.+\\}` or
    `<answer>.*</answer>`. Required when `format_weight` > 0."""

    length_penalty_weight: float = Field(0.0, ge=0)
    """Largest penalty subtracted for long responses. 0 turns it off (the default: DAPO's soft overlong
    penalty lives in the learner's algorithm config instead)."""

    length_penalty_start_tokens: int = Field(512, ge=0)
    """Responses up to this many tokens are not penalized."""

    length_penalty_window_tokens: int = Field(512, ge=1)
    """The penalty grows linearly from 0 at `length_penalty_start_tokens` to the full weight this many tokens
    later, then stays there."""

    @model_validator(mode="after")
    def _check_format(self) -> "ShapingConfig":
        if self.format_weight > 0 and not self.format_regex:
            raise ValueError(
                f"reward.shaping.format_weight={self.format_weight} needs reward.shaping.format_regex: the format "
                "reward is 1 when the response matches that pattern. Set a pattern or set format_weight to 0."
            )
        try:
            re.compile(self.format_regex)
        except re.error as err:
            raise ValueError(
                f"reward.shaping.format_regex={self.format_regex!r} is not a valid Python regex ({err}); fix the "
                "pattern (backslashes in YAML need single quotes or doubling)."
            ) from err
        return self


class CodeSandboxConfig(BaseModel):
    """Limits on each run of a candidate program (one process per test case; see rewards/code_sandbox.py)."""

    model_config = ConfigDict(extra="forbid")

    reward_mode: Literal["fraction", "all_or_nothing"] = "fraction"
    """`fraction`: reward = tests passed / tests. `all_or_nothing`: 1 only when every test passes (stops at the
    first failure, so it is also faster)."""

    run_timeout_s: float = Field(4.0, gt=0, le=600)
    """Wall-clock limit of one test run, in seconds. The whole sample also stays within `reward.timeout_s`:
    tests that would start past that budget count as failed."""

    cpu_time_s: int = Field(4, ge=1, le=600)
    """CPU-time limit of one test run (RLIMIT_CPU), in seconds."""

    memory_mb: int = Field(512, ge=64, le=65536)
    """Memory limit in MiB: address space per process (RLIMIT_AS), and memory of the whole process tree
    (its files in /tmp included) when a cgroup is used (`memory_cgroup`). Python itself needs about 30."""

    max_processes: int = Field(16, ge=1, le=4096)
    """Processes and threads the program may hold at once (RLIMIT_NPROC of a uid used by no one else)."""

    max_output_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    """Cap on stdout and on any one file the program writes (RLIMIT_FSIZE), in bytes."""

    tmpfs_mb: int = Field(64, ge=1, le=16384)
    """Size of the fresh in-memory folder mounted at /tmp (the program's working directory), in MiB."""

    readonly_paths: list[str] = Field(
        default_factory=lambda: [
            "/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32",
            "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives",
        ]
    )  # fmt: skip
    """The only host paths a program sees (read-only, at the same place; symlinks copied), besides the Python
    prefix, which is always added. Everything else does not exist inside: home folders, data, /var, /run,
    host sockets. The program's own /tmp (its working folder), /dev/shm and an empty /run are private. Never
    list a folder that holds data, credentials or Unix sockets."""

    sandbox_uid_base: int = Field(200000, ge=1000, le=(1 << 32) - (1 << 22) - 2)
    """Candidate programs run as uid `base + the launcher's pid`: the launcher lives as long as its sandbox and
    pids are unique among live processes (below 2^22), so no two sandboxes running at once on a host share a uid
    or its process limit. Pick a range no real user or container mapping uses."""

    memory_cgroup: Literal["auto", "required", "off"] = "auto"
    """Bound the whole process tree by `memory_mb` with a cgroup per run. `auto`: cgroup v2 (a delegated
    subtree) or v1's memory hierarchy when writable, else only the per-process RLIMIT_AS (then a program may use
    up to `max_processes * memory_mb`). `required`: a run without a writable memory cgroup fails closed (reward
    0, counted as an error). `off`: per-process limit only."""

    language_tags: list[str] = Field(default_factory=lambda: ["python", "py", "python3"], min_length=1)
    """Fenced blocks whose language tag (the first word after the opening ```, any case) is one of these hold the
    program; the last such block is run. Untagged blocks and other languages are never run."""

    @model_validator(mode="after")
    def _check_paths(self) -> "CodeSandboxConfig":
        for path in self.readonly_paths:
            if not path.startswith("/") or path.rstrip("/") == "" or ".." in path.split("/"):
                raise ValueError(
                    f"reward.code.readonly_paths entry {path!r} must be an absolute path below / without `..` "
                    "(the whole root cannot be shown: list the folders programs need, e.g. /usr)"
                )
        return self


class Gsm8kConfig(BaseModel):
    """How the `gsm8k` verifier reads the answer from a response (see rewards/gsm8k.py)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["strict", "flexible"] = "flexible"
    """`strict`: the answer is the number right after the response's last `####` (verl's default); a response
    without it scores 0, so the policy must learn the format. `flexible`: the first number after the last
    `####`, else the response's last number (for prompts that do not ask for `####`). In both, a minus between
    two numbers is subtraction ("10 - 5" reads 5) and Unicode minus signs are minus ("−5" is -5)."""


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verifier: str = "arithmetic"
    """Registered verifier name (`arithmetic`, `gsm8k`, `math`, `code`) or a user function as `module:function`
    (see rewards/README.md for its signature)."""

    num_workers: int = Field(1, ge=1)
    """Reward worker actors. Independent of rollout workers; raise it when verification is the bottleneck."""

    num_processes: int = Field(1, ge=1, le=256)
    """Processes per reward worker that run verifiers in parallel (CPU-heavy checks, code sandboxes)."""

    timeout_s: float = Field(10.0, gt=0)
    """Per-sample limit: a verifier past it gives reward 0 and is counted as `reward/error_timeout`
    (in the trained batch) and `reward_worker/error_timeout` (every check)."""

    error_log_interval_s: float = Field(60.0, ge=0)
    """At most one logged example per error kind per this many seconds (the counts are always exact).
    0 logs every error."""

    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    """Format reward and length penalty composed with the task reward."""

    gsm8k: Gsm8kConfig = Field(default_factory=Gsm8kConfig)
    """Answer extraction of the `gsm8k` verifier; unused by the others."""

    code: CodeSandboxConfig = Field(default_factory=CodeSandboxConfig)
    """Sandbox limits for the `code` verifier; unused by the others."""
