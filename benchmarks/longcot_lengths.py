"""The long-CoT demo's lengths and warm start, in plain torch: the length distribution of the written-out solutions
of the training mix, then (with --model, or building the cached model) greedy and sampled responses of the
warm-started model on held-out problems: their lengths and the accuracy by difficulty.

    python benchmarks/longcot_lengths.py                       # the training mix only (seconds)
    python benchmarks/longcot_lengths.py --model               # build or reuse the cached warm-started model
    python benchmarks/longcot_lengths.py --model FOLDER --samples 64
"""

import argparse
import json
import time

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from demos.longcot_model import accuracy_by_difficulty, greedy_responses_by_length, prepare_longcot_model
from protocols.config import load_config
from rewards.datasets import load_longcot_prompts
from rewards.longcot_data import longcot_problems, solution_text


def summary(lengths: list[int]) -> dict[str, float]:
    """Median, 90th and 99th percentile, longest and mean of `lengths` (tokens), and p99 over the median."""
    ordered = sorted(lengths)
    n = len(ordered)
    median = ordered[n // 2]
    p99 = ordered[min(n - 1, int(0.99 * n))]
    return {"n": n, "median": median, "p90": ordered[min(n - 1, int(0.9 * n))], "p99": p99, "max": ordered[-1],
            "mean": round(sum(ordered) / n, 1), "p99_over_median": round(p99 / median, 2)}


@torch.no_grad()
def sampled_lengths(model, tokenizer, prompts, max_new_tokens: int, temperature: float = 1.0) -> tuple[list[int], list[str]]:
    """Response lengths (tokens, EOS included when generated) and texts, sampled one prompt at a time."""
    lengths, texts = [], []
    for p in prompts:
        out = model.generate(input_ids=torch.tensor([p.prompt_token_ids]), max_new_tokens=max_new_tokens,
                             do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        row = out[0, len(p.prompt_token_ids):].tolist()
        lengths.append(row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row))
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return lengths, texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="deploy/configs/demo_longcot.yaml")
    parser.add_argument("--model", nargs="?", const="build", default="",
                        help="a warm-started folder, or no value to build (or reuse) the cached one")
    parser.add_argument("--samples", type=int, default=64, help="held-out prompts sampled at temperature 1")
    args = parser.parse_args()
    cfg = load_config(args.config)
    data = cfg.data
    pairs = longcot_problems("train", data.longcot_num_train, long_fraction=data.longcot_long_fraction,
                             max_b=data.longcot_max_b)
    report: dict = {"training_mix_solution_tokens": summary([len(solution_text(a, b)) + 1 for a, b in pairs])}
    if args.model:
        folder = prepare_longcot_model(demo=cfg.model.demo, data=data, log=print) if args.model == "build" else args.model
        report["warm_start"] = json.loads(open(f"{folder}/relayrl_ready.json").read()) if args.model == "build" else {}
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
        model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        prompts, _ = load_longcot_prompts(data, "test", tokenizer)
        start = time.perf_counter()
        greedy = greedy_responses_by_length(model, tokenizer, prompts)
        report["greedy_seconds"] = round(time.perf_counter() - start, 1)
        report["greedy_accuracy"] = accuracy_by_difficulty(prompts, greedy)
        report["greedy_response_tokens"] = summary([len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1
                                                    for t in greedy])
        report["held_out_solution_tokens"] = summary(
            [len(solution_text(p.metadata["a"], p.metadata["b"])) + 1 for p in prompts])
        sampled, texts = sampled_lengths(model, tokenizer, prompts[: args.samples], cfg.rollout.max_response_tokens)
        report["sampled_response_tokens"] = summary(sampled)
        report["sampled_accuracy"] = accuracy_by_difficulty(prompts[: args.samples], texts)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
