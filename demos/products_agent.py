"""The agent demo's agent program (deploy/configs/demo_agent.yaml, `gateway.agent: demos.products_agent:run`):
written against the OpenAI API with the stock `openai` SDK alone, as an agent outside relayrl would be. It offers
the calculator as an OpenAI function schema, runs the calls the model makes itself, sends each result back as a
`tool` message, and returns the arithmetic verifier's check of the final answer as the reward.

The run calls `run` `rollout.samples_per_prompt` times per training prompt, each on a session of a rollout worker's
endpoint (gateway/agent_runner.py). Any agent of this signature plugs in the same way."""

import asyncio
import json
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from protocols.trajectory import Prompt
from rewards.arithmetic import verify_arithmetic
from rewards.tools import calculate

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return its value.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
MAX_TURNS = 2
"""Model calls per episode: a calculator call, then the answer (a reply without a call ends it sooner)."""
_HTTP: dict[asyncio.AbstractEventLoop, Any] = {}


def http_client() -> Any:
    """One HTTP connection pool per event loop, shared by the episodes' clients: building an `AsyncOpenAI` with its
    own pool costs about 50 ms here (its TLS context), more than the episode's two calls."""
    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        _HTTP[loop] = DefaultAsyncHttpxClient()
    return _HTTP[loop]


def run_tool(name: str, arguments: str) -> str:
    """A tool call's output: the calculator's value, or the error text the model reads instead."""
    if name != "calculator":
        return f"error: unknown tool {name!r}"
    try:
        args = json.loads(arguments)
        return calculate(str(args["expression"]))
    except Exception as err:  # noqa: BLE001 - a bad call is text the model reads, as the run's own tools do
        return f"error: {type(err).__name__}"


async def run(task: dict[str, Any], base_url: str, api_key: str) -> dict[str, Any]:
    """One episode on `task` (its `prompt` text and gold `answer`): returns {"reward", "correct", "calls"}."""
    # the SDK's own retries wait out a 429 (the endpoint's back-pressure); a retried call never trains twice
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=5, timeout=120, http_client=http_client())
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["prompt"]}]
    calls = 0
    answer = ""
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            calls += 1
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    result = verify_arithmetic(Prompt(prompt_id=str(task.get("prompt_id", "")), prompt_token_ids=[],
                                      answer=str(task["answer"])), answer)
    return {"reward": result.reward, "correct": result.correct, "calls": calls}
