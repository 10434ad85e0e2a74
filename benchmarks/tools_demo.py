"""The tool demo's figures (docs/tools_demo.md): greedy held-out accuracy and tool-call rate of model folders, in
plain torch, and the comparison plot of a tool run and its no-tools row from their metrics.jsonl.

    .venv/bin/python benchmarks/tools_demo.py score demo runs/demo_tools/final_model runs/demo_tools_no_tools/final_model
    .venv/bin/python benchmarks/tools_demo.py plot runs/demo_tools runs/demo_tools_no_tools --out docs/tools_demo_run.png

`score` runs demos/tool_task.greedy_tool_rollouts_hf on the config's held-out problems (`demo` is the cached
warm-started model), with the calculator and without (one turn: a call is then the whole answer, so it is wrong).
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "demo_tools.yaml"


def score(folders: list[str], config: str) -> list[dict]:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from demos.arithmetic_model import prepare_demo_model
    from demos.tool_task import greedy_tool_rollouts_hf, tool_rollout_stats
    from protocols.config import load_config
    from rewards.datasets import load_arithmetic_prompts

    cfg = load_config(config)
    rows = []
    for folder in folders:
        path = prepare_demo_model(demo=cfg.model.demo, data=cfg.data, tools=cfg.tools) if folder == "demo" else folder
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts, _ = load_arithmetic_prompts(cfg.data, "test", tokenizer)
        with_tool = tool_rollout_stats(prompts, greedy_tool_rollouts_hf(model, tokenizer, prompts, cfg.tools))
        one_turn = cfg.tools.model_copy(update={"max_turns": 1})
        without = tool_rollout_stats(prompts, greedy_tool_rollouts_hf(model, tokenizer, prompts, one_turn))
        rows.append({"model": folder, "problems": len(prompts), "with_tool": with_tool,
                     "without_tool_accuracy": without["accuracy"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(tool_run: str, no_tool_run: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from cli.plots import load_metrics, series, smooth

    fig = Figure(figsize=(11, 3.6))
    axes = fig.subplots(1, 3)
    for run, label in ((tool_run, "with calculator"), (no_tool_run, "no tool")):
        rows, summary = load_metrics(run)
        steps, acc = series(rows, "eval/accuracy")
        if summary:
            steps = [0, *steps, summary.get("steps", steps[-1] if steps else 0)]
            acc = [summary.get("accuracy_before", float("nan")), *acc, summary.get("accuracy_after", float("nan"))]
        axes[0].plot(steps, [100 * a for a in acc], marker="o", label=label)
        x, reward = series(rows, "reward/mean")
        axes[1].plot(x, smooth(reward, 10), label=label)
        x, calls = series(rows, "tools/call_rate")
        if calls:
            axes[2].plot(x, [100 * c for c in smooth(calls, 10)], label=label)
    axes[0].set(title="held-out greedy accuracy (%)", xlabel="step")
    axes[1].set(title="training reward (mean, smoothed)", xlabel="step")
    axes[2].set(title="samples with a tool call (%)", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("score")
    s.add_argument("folders", nargs="+")
    s.add_argument("--config", default=str(CONFIG))
    p = sub.add_parser("plot")
    p.add_argument("tool_run")
    p.add_argument("no_tool_run")
    p.add_argument("--out", default="tools_demo_run.png")
    args = parser.parse_args()
    if args.command == "score":
        score(args.folders, args.config)
    else:
        plot(args.tool_run, args.no_tool_run, args.out)


if __name__ == "__main__":
    main()
