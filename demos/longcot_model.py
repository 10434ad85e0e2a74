"""The long chain-of-thought demo policy: a tiny Qwen2 model and character tokenizer for `a*b=` worked out step by
step (rewards/longcot_data.py), built locally, warm-started supervised on the written-out solutions and cached.

demos/arithmetic_model.py's `prepare_demo_model` hands `data.format: longcot` runs here; the folder then feeds the
rollout engines and the learner like the addition demo's. The warm start stops at a target accuracy (room for RL)
and refuses to hand over a model that never reached it.
"""

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from demos.arithmetic_model import BOS, EOS, PAD
from demos.model_cache import build_cached, default_cache_dir
from demos.warm_start import greedy_responses_hf, supervised_warm_start
from protocols.data import DataConfig
from protocols.model import DemoModelConfig
from protocols.trajectory import Prompt
from rewards.datasets import load_longcot_prompts
from rewards.longcot import verify_longcot
from rewards.longcot_data import EASY_MAX_B, longcot_problems, problem_text, solution_text

LONGCOT_SYMBOLS = [PAD, BOS, EOS, *"0123456789", "+", "=", "*", ":", ";", "#"]
"""The whole vocabulary, in id order: pad 0, bos 1, eos 2, digits 3-12, then `+ = * : ; #` 13-18."""

_BUILD_VERSION = 1
"""Part of the cache key: bump it when a change here changes the model that the same settings build."""


class WarmStartFailed(RuntimeError):
    """The supervised warm start ended below its target accuracy: RL from there would show nothing."""


def build_longcot_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """Write the character tokenizer (digits, `+ = * : ; #`, pad/bos/eos) to `folder` and return it. Encoding puts
    BOS in front; decoding joins characters with no spaces."""
    vocab = {symbol: i for i, symbol in enumerate(LONGCOT_SYMBOLS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD,
        clean_up_tokenization_spaces=False, model_max_length=8192,
    )
    fast.save_pretrained(str(folder))
    return fast


def build_longcot_random_model(folder: str | Path, demo: DemoModelConfig) -> str:
    """Save a randomly initialised Qwen2 model (fp32) of `demo`'s shape and the long-CoT tokenizer to `folder`."""
    if demo.num_heads % demo.num_kv_heads:
        raise ValueError(
            f"model.demo.num_heads={demo.num_heads} is not a multiple of model.demo.num_kv_heads={demo.num_kv_heads}; "
            f"use num_kv_heads in {[d for d in range(1, demo.num_heads + 1) if demo.num_heads % d == 0]}"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_longcot_tokenizer(folder)
    config = Qwen2Config(
        vocab_size=len(LONGCOT_SYMBOLS), hidden_size=demo.hidden_size, intermediate_size=demo.intermediate_size,
        num_hidden_layers=demo.num_layers, num_attention_heads=demo.num_heads, num_key_value_heads=demo.num_kv_heads,
        head_dim=demo.head_dim, max_position_embeddings=demo.max_position_embeddings, tie_word_embeddings=demo.tied,
        bos_token_id=LONGCOT_SYMBOLS.index(BOS), eos_token_id=LONGCOT_SYMBOLS.index(EOS),
        pad_token_id=LONGCOT_SYMBOLS.index(PAD), dtype="float32",
    )
    torch.manual_seed(demo.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, getattr(config, key))
    model.save_pretrained(str(folder))
    return str(folder)


def solution_rows(pairs: Sequence[tuple[int, int]], tokenizer: PreTrainedTokenizerFast) -> list[tuple[list[int], int]]:
    """Per problem: the ids of `<bos>a*b=SOLUTION<eos>` and where the solution starts (the loss covers it and EOS)."""
    rows = []
    for a, b in pairs:
        prompt_ids = tokenizer(problem_text(a, b))["input_ids"]
        target = tokenizer(solution_text(a, b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt_ids + target, len(prompt_ids)))
    return rows


def micro_batches(rows: Sequence[tuple[list[int], int]], max_tokens: int, pad_id: int):
    """Rows sorted by length and cut into padded `(input_ids, loss_mask)` micro-batches of at most `max_tokens`
    (padded) tokens each, so the few long solutions do not pad the many short ones to their length."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    chunk: list[int] = []
    for i in order + [-1]:
        width = max([len(rows[j][0]) for j in chunk + ([i] if i >= 0 else [])])
        if chunk and (i < 0 or width * (len(chunk) + 1) > max_tokens):
            w = max(len(rows[j][0]) for j in chunk)
            input_ids = torch.full((len(chunk), w), pad_id, dtype=torch.long)
            loss_mask = torch.zeros((len(chunk), w), dtype=torch.bool)
            for r, j in enumerate(chunk):
                ids, start = rows[j]
                input_ids[r, : len(ids)] = torch.tensor(ids)
                loss_mask[r, start : len(ids)] = True
            yield input_ids, loss_mask
            chunk = []
        if i >= 0:
            chunk.append(i)


def accuracy_by_difficulty(prompts: Sequence[Prompt], responses: Sequence[str]) -> dict[str, float]:
    """Greedy accuracy overall, on easy problems (b <= EASY_MAX_B) and on long ones, and the response lengths."""
    easy = [verify_longcot(p, r).correct for p, r in zip(prompts, responses) if p.metadata["b"] <= EASY_MAX_B]
    long_ = [verify_longcot(p, r).correct for p, r in zip(prompts, responses) if p.metadata["b"] > EASY_MAX_B]
    everything = easy + long_
    return {
        "accuracy": sum(everything) / max(1, len(everything)),
        "accuracy_easy": sum(easy) / max(1, len(easy)),
        "accuracy_long": sum(long_) / max(1, len(long_)),
    }


def greedy_responses_by_length(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, prompts: Sequence[Prompt], batch_size: int = 64
) -> list[str]:
    """Greedy responses, in `prompts`' order, generated in batches of problems of similar length, each batch
    capped at 1.25x its longest written-out solution plus 16 tokens: one long problem then costs its own batch,
    not every batch 1,100 decode steps. A response cut there has no answer mark and scores 0."""
    expected = [len(solution_text(p.metadata["a"], p.metadata["b"])) + 1 for p in prompts]
    order = sorted(range(len(prompts)), key=expected.__getitem__)
    out: list[str] = [""] * len(prompts)
    for begin in range(0, len(order), batch_size):
        chunk = order[begin : begin + batch_size]
        cap = int(1.25 * max(expected[i] for i in chunk)) + 16
        texts = greedy_responses_hf(model, tokenizer, [prompts[i] for i in chunk], max_new_tokens=cap,
                                    batch_size=batch_size)
        for i, text in zip(chunk, texts):
            out[i] = text
    return out


def check_prompts(data: DataConfig, tokenizer: PreTrainedTokenizerFast, count: int) -> list[Prompt]:
    """Distinct train-split problems from another seed than training's: the held-out split is never looked at."""
    return [
        Prompt(prompt_id=f"longcot/check/{i}", prompt_token_ids=tokenizer(problem_text(a, b))["input_ids"],
               prompt_text=problem_text(a, b), answer=str(a * b), metadata={"a": a, "b": b})
        for i, (a, b) in enumerate(longcot_problems(
            "train", count, long_fraction=data.longcot_long_fraction, max_b=data.longcot_max_b, seed=1, distinct=True))
    ]


def warm_start_longcot(
    folder: str | Path, data: DataConfig, demo: DemoModelConfig, *, check_every: int = 50,
    num_check_problems: int = 200, max_tokens_per_micro_batch: int = 8192, log: Any = None, progress: bool = True,
) -> dict[str, float]:
    """Supervised training on the written-out solutions (loss on the working, the answer and EOS); saves in place.

    Stops once greedy accuracy on `num_check_problems` problems it never trained on reaches
    `demo.warm_start_target_accuracy` in two checks in a row, as the addition demo's warm start does (the loop is
    demos/warm_start.py's); raises WarmStartFailed when `demo.warm_start_steps` end below it. A step's rows are cut
    into micro-batches of similar length (`micro_batches`) and its gradient norm clipped to 1.
    """
    folder = str(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    pairs = longcot_problems("train", data.longcot_num_train, long_fraction=data.longcot_long_fraction,
                             max_b=data.longcot_max_b, seed=0)
    rows = solution_rows(pairs, tokenizer)
    checks = check_prompts(data, tokenizer, num_check_problems)

    def step_micro_batches(picked: list[int], generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(micro_batches([rows[i] for i in picked], max_tokens_per_micro_batch, tokenizer.pad_token_id))

    def check(model: Qwen2ForCausalLM) -> tuple[bool, dict[str, float]]:
        figures = accuracy_by_difficulty(checks, greedy_responses_by_length(model, tokenizer, checks))
        return figures["accuracy"] >= demo.warm_start_target_accuracy, figures

    steps = demo.warm_start_steps
    # Minutes of work before the first RL step of a fresh clone: `progress` shows it (it stops early, at the target).
    result = supervised_warm_start(
        model, len(rows), step_micro_batches, steps=steps, lr=demo.warm_start_lr, batch_size=demo.warm_start_batch,
        seed=demo.seed, check=check, check_every=check_every, max_grad_norm=1.0, name="long-CoT warm start", log=log,
        progress=progress,
    )
    accuracy = result.check.get("accuracy", float("nan"))
    if accuracy < demo.warm_start_target_accuracy:
        raise WarmStartFailed(
            f"the long-CoT warm start ended at {accuracy:.1%} greedy accuracy on {len(checks)} check "
            f"problems after model.demo.warm_start_steps={steps} steps ({result.seconds:.0f} s), below "
            f"model.demo.warm_start_target_accuracy={demo.warm_start_target_accuracy}: RL from there would start "
            f"from a model that cannot write the working. Raise model.demo.warm_start_steps, lower the target, or "
            f"change model.demo.warm_start_lr={demo.warm_start_lr} (nothing was cached)."
        )
    model.save_pretrained(folder)
    return {
        **result.stats(),
        "warm_start/check_greedy_accuracy": accuracy,
        "warm_start/check_greedy_accuracy_easy": result.check.get("accuracy_easy", float("nan")),
        "warm_start/check_greedy_accuracy_long": result.check.get("accuracy_long", float("nan")),
        "warm_start/cpu_seconds_per_step": result.cpu_seconds_per_step,
    }


def longcot_model_key(demo: DemoModelConfig, data: DataConfig) -> str:
    """Cache key of the long-CoT model: every setting that changes it, hashed (apart from the addition demo's)."""
    settings: dict[str, Any] = {
        "task": "longcot",
        "build_version": _BUILD_VERSION,
        "demo": demo.model_dump(mode="json"),
        "longcot_num_train": data.longcot_num_train,
        "longcot_long_fraction": data.longcot_long_fraction,
        "longcot_max_b": data.longcot_max_b,
    }
    return "longcot-" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def prepare_longcot_model(
    cache_dir: str | Path | None = None, demo: DemoModelConfig | None = None, data: DataConfig | None = None,
    evaluate: bool = True, log: Any = None,
) -> str:
    """Folder of the warm-started long-CoT model, built once per settings and reused from the cache after (built
    in a temporary folder and renamed into place with the ready marker, as the addition demo's)."""
    demo = demo or DemoModelConfig()
    data = data or DataConfig(format="longcot")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def build(tmp: Path) -> dict[str, Any]:
        build_longcot_random_model(tmp, demo)
        stats: dict[str, Any] = warm_start_longcot(tmp, data, demo, log=log)
        if evaluate:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp))
            model = Qwen2ForCausalLM.from_pretrained(str(tmp), dtype=torch.float32)
            test_prompts, _ = load_longcot_prompts(data, "test", tokenizer)
            responses = greedy_responses_by_length(model, tokenizer, test_prompts)
            for name, value in accuracy_by_difficulty(test_prompts, responses).items():
                stats[f"warm_start/test_greedy_{name}"] = value
        stats["settings"] = {"demo": demo.model_dump(mode="json"), "data": data.model_dump(mode="json")}
        return stats

    return build_cached(cache, longcot_model_key(demo, data), build)
