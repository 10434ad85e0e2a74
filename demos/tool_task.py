"""The tool demo's pieces of the demo model (demos/arithmetic_model.py): whole-word tool tokens for the character
vocabulary, warm-start examples that call the calculator, and a plain-torch greedy rollout that runs the tool.

The warm start teaches `a*b=` -> `<tool_call>calculator:a*b</tool_call>` `<tool_response>P</tool_response>` `P<eos>`
on a share of its problems (loss on the model's tokens only: the tool's output is context), and `P<eos>` directly on
the rest. RL then raises the call rate: a direct product is almost always wrong, a copied one almost always right.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from demos.agent_task import read_call
from gateway.chat_render import ChatRenderer
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt
from rewards.arithmetic_data import problem_answer, problem_text

CALCULATOR = "calculator"
"""The tool the demo calls; its name is one token of the demo vocabulary."""


def tool_words(tools: ToolsConfig) -> list[str]:
    """Strings the demo tokenizer keeps whole (one token each): the call tags, the output template's text before
    and after `{output}`, and the calculator's name; empty strings and repeats dropped, in that order."""
    before, after = tools.output_template.split("{output}")
    return list(dict.fromkeys(w for w in (tools.call_start, tools.call_end, before, after, CALCULATOR) if w))


def call_text(a: int, b: int, op: str, tools: ToolsConfig) -> str:
    """The call the warm start teaches: `<tool_call>calculator:a*b</tool_call>` with the configured tags."""
    return f"{tools.call_start}{CALCULATOR}:{a}{op}{b}{tools.call_end}"


def tool_example(
    a: int, b: int, op: str, tokenizer: PreTrainedTokenizerFast, tools: ToolsConfig
) -> tuple[list[int], list[bool]]:
    """Token ids of prompt, call, rendered tool output, answer and EOS, and the loss mask: True on the call and
    on the answer and EOS (what the model writes), False on the prompt and on the tool output (context).

    The output is rendered and tokenized as the agent loop does (rewards/tool_calls.render_output: the template
    around the output, tokenized once without special tokens)."""
    answer = problem_answer(a, b, op)
    prompt = tokenizer(problem_text(a, b, op))["input_ids"]
    call = tokenizer(call_text(a, b, op, tools), add_special_tokens=False)["input_ids"]
    output = tokenizer(tools.output_template.replace("{output}", answer), add_special_tokens=False)["input_ids"]
    final = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = prompt + call + output + final
    mask = [False] * len(prompt) + [True] * len(call) + [False] * len(output) + [True] * len(final)
    return ids, mask


def demo_calculator(arguments: str) -> str:
    """The warm start's own check evaluates only what the demo teaches, `INT*INT` or `INT+INT` (the real runs use
    the calculator of rewards/tools.py); anything else gets an error text, as a malformed call would."""
    match = re.fullmatch(r"(\d{1,9})([+*])(\d{1,9})", arguments)
    if not match:
        return "error"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a * b if op == "*" else a + b)


@dataclass
class ToolRollout:
    """One greedy rollout: the text after the last tool output (what the verifier scores) and the calls made."""

    final_text: str
    calls: int
    response_text: str


@torch.no_grad()
def greedy_tool_rollouts_hf(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[Prompt],
    tools: ToolsConfig,
    max_new_tokens: int = 24,
    batch_size: int = 256,
    hermes: bool = False,
) -> list[ToolRollout]:
    """Greedy multi-turn rollouts with transformers `generate`: a turn ends at EOS or at the call's closing tag
    (one token in the demo vocabulary); a call is answered by `demo_calculator`, rendered with the output template
    and appended as context; at most `tools.max_turns` turns of at most `max_new_tokens` tokens each.

    `hermes` (the agent demo, demos/agent_task.py): a turn ends at EOS only; a turn holding a Hermes calculator
    call is answered as a `tool` message, rendered by the chat template's delta, as the session endpoint does."""
    eos, call_end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(tools.call_end)
    stops = [eos] if hermes else [eos, call_end]
    renderer = ChatRenderer(tokenizer) if hermes else None

    def tool_output(row: list[int]) -> list[int] | None:
        """The tokens that answer the turn's call, or None when the turn holds none (the rollout ends)."""
        text = tokenizer.decode(row, skip_special_tokens=True)
        if renderer is not None:
            expression = read_call(text)
            if expression is None:
                return None
            return renderer.delta_ids([{"role": "tool", "content": demo_calculator(expression)}], None, {})
        if row[-1] != call_end:
            return None
        body = text.rsplit(tools.call_start, 1)[-1].removesuffix(tools.call_end)
        name, _, arguments = body.partition(":")
        output = demo_calculator(arguments) if name == CALCULATOR else "unknown tool"
        return tokenizer(tools.output_template.replace("{output}", output), add_special_tokens=False)["input_ids"]

    pad = tokenizer.pad_token_id
    ids = [list(p.prompt_token_ids) for p in prompts]
    responses: list[list[int]] = [[] for _ in prompts]
    last_turn: list[list[int]] = [[] for _ in prompts]
    calls = [0] * len(prompts)
    active = list(range(len(prompts)))
    for turn in range(tools.max_turns):
        ended: list[int] = []
        for begin in range(0, len(active), batch_size):
            chunk = active[begin : begin + batch_size]
            width = max(len(ids[i]) for i in chunk)
            # Left padding, so every row's next token follows its own prefix directly.
            input_ids = torch.tensor([[pad] * (width - len(ids[i])) + ids[i] for i in chunk])
            lengths = torch.tensor([len(ids[i]) for i in chunk])
            attention_mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=stops, pad_token_id=pad)
            for i, row in zip(chunk, out[:, width:].tolist()):
                stop = next((k for k, t in enumerate(row) if t in stops), None)
                row = row if stop is None else row[: stop + 1]
                last_turn[i] = row
                responses[i] += row
                ids[i] += row
                rendered = tool_output(row) if stop is not None and turn + 1 < tools.max_turns else None
                if rendered is not None:
                    responses[i] += rendered
                    ids[i] += rendered
                    calls[i] += 1
                else:
                    ended.append(i)
        done = set(ended)
        active = [i for i in active if i not in done]
        if not active:
            break
    return [ToolRollout(final_text=tokenizer.decode(last_turn[i], skip_special_tokens=True), calls=calls[i],
                        response_text=tokenizer.decode(responses[i], skip_special_tokens=True))
            for i in range(len(prompts))]


def tool_rollout_stats(prompts: Sequence[Prompt], rollouts: Sequence[ToolRollout]) -> dict[str, float]:
    """Greedy accuracy (exact match of the final text), the share of rollouts with a call, and the accuracy of
    those that called (how well the model copies the tool's output)."""
    correct = [r.final_text.strip() == p.answer.strip() for p, r in zip(prompts, rollouts)]
    called = [r.calls > 0 for r in rollouts]
    n, n_called = max(len(rollouts), 1), sum(called)
    return {
        "accuracy": sum(correct) / n,
        "call_rate": n_called / n,
        "called_accuracy": sum(c for c, k in zip(correct, called) if k) / n_called if n_called else 0.0,
    }
