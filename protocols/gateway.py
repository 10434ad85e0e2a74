"""The settings of the session endpoint (gateway/): an OpenAI-compatible server on 127.0.0.1 that agent programs
call with the stock `openai` SDK, whose calls become token-exact training episodes. Off by default."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GatewayConfig(BaseModel):
    """`gateway.enabled: true` serves sessions from each rollout worker's engine beside the groups it generates."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Serve the endpoint. Off: rollouts are the run's own prompts only, as before."""

    host: str = "127.0.0.1"
    """Address the server binds. Loopback only: a session key is a bearer secret, and the server has no TLS."""

    port: int = Field(0, ge=0, le=65535)
    """First port; rollout worker i serves on port + i. 0: each worker takes a free port (its URL is written to
    the run folder's gateway.json)."""

    history: Literal["extend", "render"] = "extend"
    """How a call that repeats earlier turns is built: `extend` keeps them as the engine sampled them (one sample
    per episode even where the chat template would drop earlier thinking); `render` follows the template, and an
    episode splits where the template's tokens differ from the engine's (gateway/episode.py)."""

    tool_parser: Literal["hermes", "none"] = "hermes"
    """How a reply's tool calls are read into OpenAI `tool_calls`: `hermes` (Qwen2.5/Qwen3 `<tool_call>` JSON,
    as vLLM's parser reads it); `none` returns the text as content."""

    model_name: str = Field("relayrl", min_length=1)
    """The model id /v1/models lists and replies carry. Requests may name any model: the run's policy serves."""

    max_sessions: int = Field(1024, ge=1)
    """Open sessions per worker; a new session past it is answered 429 with Retry-After."""

    max_calls_in_flight: int = Field(64, ge=1)
    """Calls a worker's engine serves at once for the endpoint; past it a call is answered 429 with Retry-After
    (never dropped silently). Its groups and these calls share the engine's rollout.max_num_seqs."""

    retry_after_s: int = Field(1, ge=1, le=3600)
    """Seconds a 429 asks the client to wait (the Retry-After header)."""

    session_timeout_s: float = Field(600.0, gt=0)
    """A session's deadline from its creation (a client may ask for less). A session with no reward by then is
    finished untrained, and counted."""

    max_request_bytes: int = Field(16 * 2**20, ge=1024)
    """Largest request body the endpoint reads; a larger one is answered 413 as soon as it passes the bound, never
    read whole (a body is held in the rollout worker's memory). 16 MiB holds a conversation of millions of
    characters."""

    max_tokens: int | None = Field(None, ge=1)
    """Most new tokens per call; None: rollout.max_response_tokens. A request's max_tokens is clamped to it."""

    agent: str = Field("", pattern=r"^$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """`module:function` of an in-process agent, `async def run(task, base_url, api_key) -> float | dict | None`,
    importable by the rollout workers; empty: none (agents outside the run create their own sessions). Set, each
    rollout worker plays every prompt it leases from the run's data set with it: `rollout.samples_per_prompt`
    runs at once, each in its own session of the worker's endpoint, which together form the leased group
    (gateway/agent_runner.py). `task` is the prompt's row (`prompt`, `answer`, `prompt_id` and its metadata); the
    return value is the session's reward (a number, or a dict with `reward`; None: not trained, counted)."""

    verifiers_env: str = Field("", pattern=r"^$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """`module:function` returning a `verifiers` environment (verifiers 0.4.0's `verifiers.v1.Env`, or one of its
    shape), importable by the rollout workers; empty: none. Set, it is the run's in-process agent in place of
    gateway.agent: each session plays one episode (`Env.run_episode`) whose model calls go to the session's
    endpoint, and the episode's rubric reward is the session's (gateway/verifiers_env.py). Install the package with
    `pip install relayrl[verifiers]` for environments written against it."""

    outside_only: bool = False
    """Feed the run by outside agents alone (AReaL's online proxy, rLLM's and verl's gateways): the rollout workers
    lease no prompts and the data set is not loaded (the data section still describes the demo model's task); every
    training group is a group of sessions that programs outside the run opened on the endpoints (POST /sessions),
    drove with the OpenAI API and rewarded. `RUN/gateway/endpoints.json` lists the endpoints and says when the run
    serves them (`ready`). A step waits for `learner.prompts_per_step` such groups within fault.batch_timeout_s,
    logging what it waits for every fault.wait_log_s. Off: the run's data set feeds it, and outside sessions add
    groups beside (docs/agents.md)."""

    agent_timeout_s: float = Field(300.0, gt=0)
    """Wall seconds one agent run may take; past it the run is cancelled, its session finished untrained and
    counted (`agent_timeouts`). Keep it under session_timeout_s."""

    @field_validator("host")
    @classmethod
    def _loopback(cls, host: str) -> str:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"gateway.host={host!r}: the session endpoint binds loopback only (127.0.0.1, ::1 or "
                             "localhost); reach it from elsewhere through an SSH tunnel or a proxy you secure")
        return host
