"""The agent demo's pieces of the demo model (demos/arithmetic_model.py with `tools.call_format: hermes`): a chat
template with tool support, so the demo writes the real Hermes format that gateway/hermes.py reads, and the warm
start's examples in it. The session endpoint renders every prompt and tool result with this template, and
demos/products_agent.py talks to it through the stock `openai` SDK (deploy/configs/demo_agent.yaml).

The demo vocabulary has no letters, so the fixed pieces of the call's JSON are whole non-special tokens: the model
writes `<tool_call>{"name": "calculator", "arguments": {"expression": "123*4567"}}</tool_call><eos>` in 13
tokens, and the text IS Hermes JSON. The template lists the offered tools by name (`<tools>calculator</tools>`):
their schemas' prose is not in the vocabulary. A rollout:

    prompt  <bos><tools>calculator</tools>123*4567=
    model   <tool_call>{"name": "calculator", "arguments": {"expression": "123*4567"}}</tool_call><eos>
    tool    <tool_response>561741</tool_response>            (the `tool` message: context, no loss)
    model   561741<eos>
"""

import json

from transformers import PreTrainedTokenizerFast

from gateway.chat_render import ChatRenderer
from gateway.hermes import parse_hermes
from protocols.tools import ToolsConfig
from rewards.arithmetic_data import problem_answer, problem_text

CALCULATOR_SCHEMA = ToolsConfig(builtin=["calculator"], call_format="hermes").schemas()[0]
"""The calculator as an OpenAI function schema (one string argument, `expression`): what the built-in agent loop
offers and demos/products_agent.py sends."""

CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
HERMES_WORDS = ["<tools>", "</tools>", CALL_HEAD, CALL_TAIL]
"""Whole tokens the agent demo adds after the tool demo's words: the tool list's tags and the call's fixed JSON."""

DEMO_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}{{- f.name }}"
    "{%- endfor %}{{- '</tools>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}{{- message.content }}"
    "{%- elif message.role == 'assistant' %}{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' ~ f.name ~ '\", \"arguments\": ' ~ (f.arguments | tojson) ~ '}</tool_call>' }}"
    "{%- endfor %}{{- eos_token }}"
    "{%- elif message.role == 'tool' %}{{- '<tool_response>' ~ message.content ~ '</tool_response>' }}"
    "{%- endif %}"
    "{%- endfor %}"
)
"""The demo's chat template: BOS, the tools by name, then each turn with no role markers (the model answers after
the user's text or a tool result); an assistant turn is its content, its calls as Hermes JSON, and EOS (the turn
end the engine stops at); a `tool` message is `<tool_response>OUTPUT</tool_response>`. No generation prompt."""


def uses_hermes(tools: ToolsConfig | None) -> bool:
    """The demo model is built for the agent demo: the Hermes words in its vocabulary and the chat template."""
    return tools is not None and tools.call_format == "hermes"


def call_message(a: int, b: int, op: str) -> dict:
    """The assistant's calculator call, as OpenAI JSON (arguments as JSON text)."""
    arguments = json.dumps({"expression": f"{a}{op}{b}"})
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]}


def hermes_example(a: int, b: int, op: str, tokenizer: PreTrainedTokenizerFast,
                   call: bool) -> tuple[list[int], list[bool]]:
    """Token ids of one warm-start conversation and its loss mask, True on what the model writes. With `call`:
    the prompt, the call turn (loss), the tool's result (context) and the answer turn (loss); else the prompt and
    the answer turn. Built as the endpoint builds an episode: the prompt by the template, each later message by
    the template's delta after the turn's end (gateway/chat_render.py), the model's turns as their text's ids."""
    renderer = ChatRenderer(tokenizer)
    answer = problem_answer(a, b, op)
    prompt = renderer.prompt_ids([{"role": "user", "content": problem_text(a, b, op)}], [CALCULATOR_SCHEMA], {})
    final = renderer.encode(answer) + renderer.turn_end_ids
    if not call:
        return prompt + final, [False] * len(prompt) + [True] * len(final)
    turn = renderer.encode(f"<tool_call>{CALL_HEAD}{a}{op}{b}{CALL_TAIL}</tool_call>") + renderer.turn_end_ids
    output = renderer.delta_ids([{"role": "tool", "content": answer}], [CALCULATOR_SCHEMA], {})
    ids = prompt + turn + output + final
    return ids, [False] * len(prompt) + [True] * len(turn) + [False] * len(output) + [True] * len(final)


def read_call(text: str) -> str | None:
    """The calculator expression of a model turn's Hermes call (gateway/hermes.py), or None: no call, a call that
    does not parse, another tool, or arguments without a string `expression`."""
    reply = parse_hermes(text)
    if reply.error or not reply.tool_calls:
        return None
    function = reply.tool_calls[0]["function"]
    arguments = json.loads(function["arguments"])
    if function["name"] != "calculator" or not isinstance(arguments, dict):
        return None
    expression = arguments.get("expression")
    return expression if isinstance(expression, str) else None
