"""The evaluation harness: greedy accuracy, pass@1 and unbiased pass@k of a policy on a held-out set, and a
JSONL row for every generation (prompt id, response, extracted answer, score, error).

Generation runs on rollout workers (vLLM) and scoring on reward workers (their timeouts and per-prompt
verifiers), as in training. `relayrl eval` starts its own workers on a model folder (`run_eval`); during
training the driver calls `evaluate_sets` on `train.eval_sets` with the run's workers.
"""

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from actors.reward_worker import results_on_workers, score_on_workers
from cluster.model_folder import fit_lengths_to_model, resolve_model_path
from cluster.waits import get_within
from protocols.config import RunConfig
from protocols.data import DataConfig
from protocols.metrics import eval_metrics
from protocols.reward import RewardConfig
from protocols.trajectory import Prompt
from rewards.datasets import DataError, load_prompts
from rewards.environment import prompt_tools
from rewards.pass_at_k import mean_pass_at_k, powers_of_two_up_to

log = logging.getLogger(__name__)

BUILTIN_SETS = {"demo": "the arithmetic demo task's held-out problems (verifier arithmetic)",
                "longcot": "the long chain-of-thought demo task's held-out problems (verifier longcot)",
                "gsm8k": "the GSM8K test file, ../shared/data/gsm8k/test.jsonl or $RELAYRL_SHARED_DIR "
                         "(verifier gsm8k)"}
FIELD_KEYS = {"prompt": "prompt_field", "answer": "answer_field", "tests": "tests_field"}
"""`--field KEY=COLUMN` keys and the data settings they set."""


class EvalInputError(ValueError):
    """A model folder or data set the harness cannot use; the message names the path, line and field."""


# ----- inputs -------------------------------------------------------------------------------------------------
def gsm8k_test_file() -> Path:
    """The shared GSM8K test split: $RELAYRL_SHARED_DIR/data/gsm8k/test.jsonl, else ../shared beside the repo."""
    shared = os.environ.get("RELAYRL_SHARED_DIR")
    root = Path(shared) if shared else Path(__file__).resolve().parents[2] / "shared"
    return root / "data" / "gsm8k" / "test.jsonl"


def parse_fields(items: list[str]) -> dict[str, str]:
    """`["prompt=question", "answer=gold"]` -> {"prompt_field": "question", "answer_field": "gold"}."""
    out = {}
    for item in items:
        key, sep, column = item.partition("=")
        if not sep or key not in FIELD_KEYS or not column:
            raise EvalInputError(f"--field {item!r} must be KEY=COLUMN with KEY one of {sorted(FIELD_KEYS)}, "
                                 "e.g. --field prompt=question --field answer=gold")
        out[FIELD_KEYS[key]] = column
    return out


def eval_data_config(name_or_file: str, base: DataConfig, fields: dict[str, str] | None = None
                     ) -> tuple[str, DataConfig, str]:
    """(set name, a data config whose `test` split is the set, the verifier its prompts carry or "" for the
    run's reward.verifier). Built-in names: `demo`, `gsm8k`; anything else is a JSONL or Parquet file read
    through `fields` (prompt_field/answer_field/tests_field), or the base config's mapping."""
    if name_or_file == "demo":
        return "demo", base.model_copy(update={"format": "arithmetic"}), "arithmetic"
    if name_or_file == "longcot":
        return "longcot", base.model_copy(update={"format": "longcot"}), "longcot"
    if name_or_file == "gsm8k":
        path = gsm8k_test_file()
        if not path.is_file():
            raise EvalInputError(f"the built-in set gsm8k reads {path}, which does not exist; put GSM8K's "
                                 "test.jsonl there, set RELAYRL_SHARED_DIR, or pass the file's path instead")
        return "gsm8k", base.model_copy(update={"format": "gsm8k", "test_path": str(path)}), "gsm8k"
    path = Path(name_or_file)
    if not path.is_file():
        raise EvalInputError(f"data set {name_or_file!r} is neither a built-in set ({', '.join(BUILTIN_SETS)}) nor "
                             "an existing JSONL or Parquet file")
    fmt = "parquet" if path.suffix == ".parquet" else "jsonl"
    return path.stem, base.model_copy(update={"format": fmt, "test_path": str(path), **(fields or {})}), ""


def check_model_folder(path: str) -> None:
    """A Hugging Face model folder: config.json (valid JSON with `model_type`), weights and a tokenizer.
    Raises EvalInputError naming the path, the line and the field at fault."""
    folder = Path(path)
    if not folder.is_dir():
        raise EvalInputError(f"--model {path!r} is not a folder; give a Hugging Face model folder "
                             "(config.json, weights, tokenizer), e.g. runs/demo/final_model")
    config = folder / "config.json"
    if not config.is_file():
        raise EvalInputError(f"{config}: missing, so {path!r} is not a Hugging Face model folder; give the folder "
                             "that holds config.json, the weights and the tokenizer")
    try:
        data = json.loads(config.read_text())
    except json.JSONDecodeError as err:
        raise EvalInputError(f"{config}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise EvalInputError(f"{config}:1: no field 'model_type', so transformers and vLLM cannot tell the "
                             "architecture; this is not a Hugging Face model config")
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("pytorch_model*.bin")):
        raise EvalInputError(f"{path}: no weights (*.safetensors or pytorch_model*.bin) beside config.json")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise EvalInputError(f"{path}: no tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model)")


@dataclass
class EvalSet:
    name: str
    prompts: list[Prompt]


def load_eval_set(name_or_file: str, base: DataConfig, tokenizer: Any, fields: dict[str, str] | None = None,
                  tools: list[dict] | None = None) -> EvalSet:
    """The set's prompts (at most base.num_eval_prompts), each carrying its verifier. Bad rows raise
    EvalInputError naming the file, the line and the field."""
    name, data_cfg, verifier = eval_data_config(name_or_file, base, fields)
    try:
        prompts, _ = load_prompts(data_cfg, "test", tokenizer, tools)
    except DataError as err:
        hint = " (mapped with --field KEY=COLUMN, KEY one of prompt, answer, tests)" if fields is not None else ""
        raise EvalInputError(f"{err}{hint}") from None
    if not prompts:
        raise EvalInputError(f"data set {name_or_file!r} gave no prompts (all longer than data.max_prompt_tokens="
                             f"{data_cfg.max_prompt_tokens}?)")
    if verifier:
        prompts = [p.model_copy(update={"verifier": verifier}) for p in prompts]
    return EvalSet(name, prompts)


# ----- the harness --------------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    name: str
    prompts: int
    samples: int
    greedy_accuracy: float
    pass_at_k: dict[int, float]
    errors: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def summary(self) -> dict:
        return {"set": self.name, "prompts": self.prompts, "samples_per_prompt": self.samples,
                "greedy_accuracy": self.greedy_accuracy, "pass_at_k": dict(self.pass_at_k),
                "errors": dict(self.errors), "seconds": self.seconds}


def evaluate_set(rollout_workers: list, reward_workers: list, eval_set: EvalSet, samples: int,
                 reward_cfg: RewardConfig, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                 rows_path: str | Path | None = None, timeout_s: float = 3600.0) -> EvalResult:
    """Greedy accuracy, and with samples = K >= 1 pass@k for k = 1, 2, 4, ... K from K draws per prompt at
    `temperature`. Every generation is scored by the reward workers; a failed check counts as wrong and is
    counted by kind. With `rows_path`, writes one JSON line per generation. The generation is bounded by
    `timeout_s` (fault.eval_timeout_s)."""
    start = time.perf_counter()
    prompts = eval_set.prompts
    chunks = [prompts[i::len(rollout_workers)] for i in range(len(rollout_workers))]
    greedy_refs = [w.generate_eval.remote(c, 1, 0.0, 1.0, seed) for w, c in zip(rollout_workers, chunks) if c]
    sampled_refs = [w.generate_eval.remote(c, samples, temperature, top_p, seed)
                    for w, c in zip(rollout_workers, chunks) if c] if samples > 0 else []
    ordered = [p for c in chunks if c for p in c]
    done = get_within([*greedy_refs, *sampled_refs], timeout_s, f"evaluation of {eval_set.name}",
                      "fault.eval_timeout_s")
    greedy = [outs[0] for chunk in done[:len(greedy_refs)] for outs in chunk]
    sampled = ([outs for chunk in done[len(greedy_refs):] for outs in chunk] if samples > 0
               else [[] for _ in ordered])
    # one flat list of (prompt, sample index (-1 greedy), generation) to score in one pass
    flat = [(p, -1, g) for p, g in zip(ordered, greedy)]
    flat += [(p, i, o) for p, outs in zip(ordered, sampled) for i, o in enumerate(outs)]
    results = results_on_workers(reward_workers, [f[0] for f in flat], [f[2]["text"] for f in flat], reward_cfg)
    errors = Counter(r.error for r in results if r.error)
    greedy_correct = sum(r.correct for (_, index, _), r in zip(flat, results) if index < 0)
    correct_by_prompt: Counter = Counter()
    for (prompt, index, _), result in zip(flat, results):
        if index >= 0 and result.correct:
            correct_by_prompt[prompt.prompt_id] += 1
    counts = [(samples, correct_by_prompt[p.prompt_id]) for p in ordered]
    pass_k = {k: mean_pass_at_k(counts, k) for k in powers_of_two_up_to(samples)}
    if errors:
        log.warning("evaluation of %s: %d of %d checks failed and count as wrong (%s)", eval_set.name,
                    sum(errors.values()), len(flat), ", ".join(f"{k} {n}" for k, n in sorted(errors.items())))
    if rows_path is not None:
        write_rows(rows_path, eval_set.name, flat, results)
    return EvalResult(eval_set.name, len(ordered), samples, greedy_correct / max(len(ordered), 1), pass_k, errors,
                      time.perf_counter() - start)


def write_rows(path: str | Path, set_name: str, flat: list[tuple], results: list) -> None:
    """One JSON line per generation: set, prompt_id, sample (-1 greedy, else 0..K-1), response (with tools: the
    whole text, tool segments included; the verifier scored the final answer), tokens, finish_reason, gold,
    extracted (the verifier's reading of the answer, null if it has none), reward, correct, error ("" when the
    check ran), and with tools tool_calls (how many the response made)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for (prompt, index, gen), result in zip(flat, results, strict=True):
            f.write(json.dumps({
                "set": set_name, "prompt_id": prompt.prompt_id, "sample": index,
                "response": gen.get("response", gen["text"]),
                "tokens": gen["tokens"], "finish_reason": gen["finish_reason"], "gold": prompt.answer,
                "extracted": result.info.get("extracted"), "reward": result.reward, "correct": result.correct,
                "error": result.error, **({"tool_calls": gen["tool_calls"]} if "tool_calls" in gen else {}),
            }) + "\n")


# ----- during training ----------------------------------------------------------------------------------------
def load_eval_sets(cfg: RunConfig, tokenizer: Any) -> list[EvalSet]:
    """train.eval_sets, loaded before any actor starts (a bad file fails here with its path and line)."""
    return [load_eval_set(name, cfg.data, tokenizer, tools=prompt_tools(cfg.tools)) for name in cfg.train.eval_sets]


def evaluate(workers: list, prompts: list[Prompt], reward_workers: list, reward_cfg: RewardConfig,
             report: dict | None = None, timeout_s: float = 3600.0) -> float:
    """Greedy held-out accuracy: prompts split over the rollout workers, responses scored by the reward workers
    (with their timeouts, each prompt's own verifier and the run's `reward.*` settings). A verifier error or
    timeout, or a reward worker lost, counts as wrong and is logged with counts by kind (also put in `report`,
    when given, as `eval/error_<kind>` and `eval/samples`); it never stops the run."""
    if not prompts:
        return float("nan")
    chunks = [prompts[i::len(workers)] for i in range(len(workers))]
    texts = get_within([w.generate_greedy.remote(c) for w, c in zip(workers, chunks)], timeout_s,
                       "held-out evaluation", "fault.eval_timeout_s")
    flat_prompts = [p for chunk in chunks for p in chunk]
    flat_texts = [t for outs in texts for t in outs]
    correct, errors = score_on_workers(reward_workers, flat_prompts, flat_texts, reward_cfg)
    if errors:
        log.warning("held-out evaluation: %d of %d checks failed and count as wrong (%s)", sum(errors.values()),
                    len(prompts), ", ".join(f"{kind} {n}" for kind, n in sorted(errors.items())))
    if report is not None:
        report["eval/samples"] = len(prompts)
        report.update({f"eval/error_{kind}": n for kind, n in errors.items()})
        report.update(source_accuracy(flat_prompts, correct))
    return sum(correct) / len(prompts)


def source_accuracy(prompts: list[Prompt], correct: list[bool]) -> dict[str, float]:
    """eval/<source>/accuracy and eval/<source>/samples for each source of a mixture (each prompt's
    `metadata.data_source`, data.tasks); {} when no prompt names one."""
    hits: dict[str, list[bool]] = {}
    for prompt, right in zip(prompts, correct):
        source = prompt.metadata.get("data_source")
        if source is not None:
            hits.setdefault(str(source), []).append(bool(right))
    out: dict[str, float] = {}
    for source, values in sorted(hits.items()):
        out[f"eval/{source}/accuracy"] = sum(values) / len(values)
        out[f"eval/{source}/samples"] = float(len(values))
    return out


def evaluate_sets(rollout_workers: list, reward_workers: list, eval_sets: list[EvalSet], cfg: RunConfig,
                  step: int) -> dict[str, float]:
    """`eval/<set>/*` metrics for each set; generations go to <output_dir>/eval/<set>_step<step>.jsonl."""
    metrics: dict[str, float] = {}
    for eval_set in eval_sets:
        result = evaluate_set(rollout_workers, reward_workers, eval_set, cfg.train.eval_samples, cfg.reward,
                              cfg.train.eval_temperature, cfg.train.eval_top_p, cfg.train.seed,
                              Path(cfg.output_dir) / "eval" / f"{eval_set.name}_step{step:06d}.jsonl",
                              cfg.fault.eval_timeout_s)
        metrics.update(eval_metrics(eval_set.name, result.summary()))
    return metrics


# ----- `relayrl eval` -----------------------------------------------------------------------------------------
def run_eval(cfg: RunConfig, model: str, data: str, samples: int, fields: dict[str, str] | None,
             output_dir: str) -> dict:
    """Evaluate a model folder on one set with workers of its own (rollout.num_workers engines,
    reward.num_workers verifiers) on the local Ray or the cluster at cluster.address / RAY_ADDRESS. Writes
    <output_dir>/generations.jsonl and summary.json; returns the summary. Inputs are checked before Ray starts."""
    from transformers import AutoTokenizer

    from actors.reward_worker import RewardWorker
    from actors.rollout_worker import RolloutWorker
    from cluster.placement import create_placement
    from cluster.ray_setup import reward_options, rollout_options, start_ray

    if model == "demo":  # the config's cached warm-started demo model (built on first use), as `relayrl train` uses
        model = resolve_model_path(cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": ""})}))
    check_model_folder(model)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": model})})
    cfg = fit_lengths_to_model(cfg, model)
    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=cfg.model.trust_remote_code)
    eval_set = load_eval_set(data, cfg.data, tokenizer, fields, prompt_tools(cfg.tools))
    started = not ray.is_initialized()
    start_ray(cfg)
    placement = create_placement(cfg, roles=("rollout", "reward"))
    rollout, reward = [], []
    try:
        reward = [ray.remote(RewardWorker).options(**reward_options(cfg, placement, i)).remote(cfg.reward, i)
                  for i in range(cfg.reward.num_workers)]
        rollout = [ray.remote(RolloutWorker).options(**rollout_options(cfg, placement, i)).remote(cfg, i, model)
                   for i in range(cfg.rollout.num_workers)]
        out = Path(output_dir)
        result = evaluate_set(rollout, reward, eval_set, samples, cfg.reward, cfg.train.eval_temperature,
                              cfg.train.eval_top_p, cfg.train.seed, out / "generations.jsonl")
    finally:
        for actor in [*rollout, *reward]:
            ray.kill(actor)
        placement.remove()
        if started:
            ray.shutdown()
    summary = {**result.summary(), "model": model, "data": data, "temperature": cfg.train.eval_temperature,
               "top_p": cfg.train.eval_top_p,
               "generations": str(out / "generations.jsonl")}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
