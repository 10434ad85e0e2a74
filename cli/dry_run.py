"""`relayrl train --config FILE --dry-run`: check what a run needs and print what it would start, starting nothing.

Checks the config (and the settings the trainer refuses before any actor starts), the model folder (config.json,
weights, tokenizer, context length), the data (the first rows of each split parsed with the configured fields
and tokenized) and the placement plan (cluster/placement.py, as `relayrl plan`). No Ray, actor or engine starts.
"""

import itertools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cluster.model_folder import fit_lengths_to_model
from protocols.config import RunConfig

Status = Literal["ok", "error", "not checkable here"]

PREVIEW_ROWS = 3
"""Rows of each data file parsed and tokenized."""


@dataclass
class Check:
    name: str
    status: Status
    detail: str


def check_settings(cfg: RunConfig) -> Check:
    """What the trainer refuses before any actor starts, beyond the schema load_config already enforced."""
    from rewards.registry import resolve_verifier

    try:
        resolve_verifier(cfg.reward.verifier)
    except ValueError as err:
        return Check("config", "error", str(err))
    return Check("config", "ok", f"valid; preset {cfg.algorithm.preset}, verifier {cfg.reward.verifier}")


def fit_context(cfg: RunConfig, folder: Path) -> tuple[RunConfig, str]:
    """(the config as the trainer would adjust it to the model's context, a note when it changes). Raises
    ValueError when no prompt fits."""
    fitted = fit_lengths_to_model(cfg, str(folder))
    if fitted.data.max_prompt_tokens == cfg.data.max_prompt_tokens:
        return fitted, ""
    return fitted, (f"; data.max_prompt_tokens={cfg.data.max_prompt_tokens} would be lowered to "
                    f"{fitted.data.max_prompt_tokens} to fit the context")


def check_model(cfg: RunConfig) -> tuple[Check, Any, RunConfig]:
    """(the check, the tokenizer or None, the config fitted to the model's context). The demo model is never
    built here: its cache is looked up."""
    from transformers import AutoTokenizer

    if not cfg.model.path and cfg.data.format == "longcot":
        from demos.longcot_model import build_longcot_tokenizer, longcot_model_key
        from demos.model_cache import default_cache_dir

        folder = default_cache_dir() / longcot_model_key(cfg.model.demo, cfg.data)
        if (folder / "config.json").is_file():
            cfg, note = fit_context(cfg, folder)
            where = f"cached at {folder}{note}"
        else:
            where = f"not built yet: the run builds it (random init + warm start) and caches it at {folder}"
        with tempfile.TemporaryDirectory(prefix="relayrl-dry-run-") as tmp:
            tokenizer = build_longcot_tokenizer(tmp)
        return Check("model", "ok", f"built-in long-CoT demo model (context {cfg.model.demo.max_position_embeddings} "
                                    f"tokens), {where}"), tokenizer, cfg
    if not cfg.model.path:
        from demos.arithmetic_model import build_tokenizer, demo_model_key, uses_tool_vocabulary
        from demos.model_cache import default_cache_dir

        folder = default_cache_dir() / demo_model_key(cfg.model.demo, cfg.data, cfg.tools)
        note = ""
        if (folder / "config.json").is_file():
            where = f"cached at {folder}"
            cfg, note = fit_context(cfg, folder)
        else:
            where = f"not built yet: the run builds it (random init + warm start) and caches it at {folder}"
        # The demo tokenizer is written by code; a temporary copy serves the data check.
        with tempfile.TemporaryDirectory(prefix="relayrl-dry-run-") as tmp:
            tokenizer = build_tokenizer(tmp, cfg.tools if uses_tool_vocabulary(cfg.model.demo, cfg.data) else None)
        d = cfg.model.demo
        return Check("model", "ok", f"built-in demo model ({d.num_layers} layers, hidden {d.hidden_size}, context "
                                    f"{d.max_position_embeddings} tokens), {where}{note}"), tokenizer, cfg
    folder = Path(cfg.model.path)
    if not folder.is_dir():
        return Check("model", "error",
                     f"model.path={cfg.model.path!r} does not exist on this machine. The folder must be readable "
                     "where the run starts its learner and rollout workers; run the dry run on such a node, or pass "
                     "model.path=FOLDER of a local Hugging Face model"), None, cfg
    config_file = folder / "config.json"
    if not config_file.is_file():
        return Check("model", "error", f"model.path={cfg.model.path!r} is not a Hugging Face model folder: no "
                                       "config.json there"), None, cfg
    try:
        model_cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        return Check("model", "error", f"{config_file}: not valid JSON ({err.msg} at line {err.lineno})"), None, cfg
    weights = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    if not weights:
        return Check("model", "error", f"model.path={cfg.model.path!r} has config.json but no weights "
                                       "(*.safetensors or *.bin)"), None, cfg
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as err:
        return Check("model", "error", f"model.path={cfg.model.path!r}: its tokenizer does not load ({err})"), None, cfg
    context = model_cfg.get("max_position_embeddings")
    detail = (f"{folder}: {model_cfg.get('model_type', '?')} {(model_cfg.get('architectures') or ['?'])[0]}, "
              f"{len(weights)} weight file(s), vocabulary {len(tokenizer)}, context {context} tokens")
    try:
        cfg, note = fit_context(cfg, folder)
    except ValueError as err:
        return Check("model", "error", str(err)), tokenizer, cfg
    return Check("model", "ok", detail + note), tokenizer, cfg


def check_data(cfg: RunConfig, split: Literal["train", "test"], tokenizer: Any) -> Check:
    """The split's first rows through the configured field mapping, template and tokenizer."""
    from rewards.datasets import DataError, _map_row, _rows, encode_prompt, load_arithmetic_prompts

    name = f"data ({split})"
    if cfg.data.format == "longcot":
        from rewards.datasets import load_longcot_prompts

        prompts, counts = load_longcot_prompts(cfg.data, split, tokenizer)
        if not prompts:
            return Check(name, "error", f"no long-CoT prompt fits data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
        return Check(name, "ok", f"built-in long-CoT task: {len(prompts)} generated problems, e.g. "
                                 f"{prompts[0].prompt_text!r}, {counts['data/skipped_too_long']} over data.max_prompt_tokens")
    if cfg.data.format == "arithmetic":
        prompts, counts = load_arithmetic_prompts(cfg.data, split, tokenizer)
        if not prompts:
            return Check(name, "error", f"no arithmetic prompt fits data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
        return Check(name, "ok", f"built-in arithmetic task: {len(prompts)} generated problems (operands "
                                 f"{cfg.data.arithmetic_min_operand} to {cfg.data.arithmetic_max_operand}), "
                                 f"e.g. {prompts[0].prompt_text!r} = "
                                 f"{len(prompts[0].prompt_token_ids)} tokens, {counts['data/skipped_too_long']} "
                                 "over data.max_prompt_tokens")
    setting = "data.train_path" if split == "train" else "data.test_path"
    path = cfg.data.train_path if split == "train" else cfg.data.test_path
    if not path:
        return Check(name, "error", f"{setting} is empty but data.format={cfg.data.format!r} reads a file")
    if not Path(path).is_file():
        return Check(name, "error", f"{setting}={path!r} (resolved from {os.getcwd()}: {Path(path).resolve()}) "
                                    "does not exist or is not a file")
    try:
        rows = list(itertools.islice(_rows(path, cfg.data.format), PREVIEW_ROWS))
        mapped = [(where, *_map_row(row, cfg.data, where)) for where, _, row in rows]
        lengths = [len(encode_prompt(cfg.data.prompt_template.replace("{prompt}", text), cfg.data, tokenizer))
                   for _, text, _, _ in mapped] if tokenizer is not None else []
    except DataError as err:
        return Check(name, "error", str(err))
    if not mapped:
        return Check(name, "error", f"{setting}={path!r} holds no rows")
    gold = mapped[0][2]
    detail = f"{path}: first {len(mapped)} rows parsed, first gold answer {gold[:40]!r}; "
    if not lengths:
        return Check(name, "ok", detail + "prompts not tokenized (no tokenizer: the model check failed)")
    over = sum(n > cfg.data.max_prompt_tokens for n in lengths)
    return Check(name, "ok", detail + f"prompts of {min(lengths)}-{max(lengths)} tokens (limit "
                                      f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}, {over} over it)")


def check_placement(cfg: RunConfig, node_specs: list[str]) -> tuple[Check, str]:
    """(the check, the plan as `relayrl plan` prints it). Never joins or starts a cluster."""
    from cluster.placement import (PlacementError, check_plan, describe, local_nodes, parse_node_spec,
                                   plan_placement)

    plan = plan_placement(cfg)
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    if node_specs:
        try:
            nodes = [n for spec in node_specs for n in parse_node_spec(spec)]
        except ValueError as err:
            return Check("placement", "error", str(err)), ""
        nodes, source = [type(n)(f"node{i}", n.resources) for i, n in enumerate(nodes)], "the --node specs"
    elif address:
        needs = ", ".join(f"{v:g} {k}" for k, v in plan.totals().items())
        roles = "\n".join(describe(plan, [], None).splitlines()[:-2])
        return Check("placement", "not checkable here",
                     f"the run joins the Ray cluster at {address!r}, which a dry run does not contact; it needs "
                     f"{needs}. Check it with `relayrl plan --config FILE` against the running cluster, or add "
                     "--node SPEC (e.g. --node 2xGPU=8,CPU=96)"), roles
    else:
        nodes, source = local_nodes(cfg), "the embedded local cluster this machine would start"
    try:
        assignment = check_plan(plan, nodes)
    except PlacementError as err:
        return Check("placement", "error", f"refused on {source}: {err}"), describe(plan, nodes, None)
    return Check("placement", "ok", f"fits {source}"), describe(plan, nodes, assignment)


def would_start(cfg: RunConfig) -> list[str]:
    """What `relayrl train` would start with this config, one line per actor group."""
    r, rw, ln, t = cfg.rollout, cfg.reward, cfg.learner, cfg.train
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
    ray_line = (f"join the Ray cluster at {address!r}" if address else
                f"an embedded local Ray cluster ({cfg.cluster.num_cpus or 'all'} CPUs)")
    device = f"{r.tensor_parallel_size} GPU(s) each" if cfg.cluster.use_gpus else "on CPU"
    model = cfg.model.path or "the demo model"
    logs = "metrics.jsonl, TensorBoard" + (f", W&B ({cfg.logging.wandb_mode})" if cfg.logging.wandb else "")
    return [
        f"Ray: {ray_line}",
        "controller: 1 actor (prompt cursor, admission, replay queue, weight versions)",
        f"rollout: {r.num_workers} vLLM engine(s), {device}, {model} in {cfg.model.dtype}, up to "
        f"{cfg.data.max_prompt_tokens}+{r.max_response_tokens} tokens, {r.max_num_seqs} sequences at once",
        f"reward: {rw.num_workers} worker(s) x {rw.num_processes} verifier process(es), verifier {rw.verifier}",
        f"learner: {ln.num_ranks} DeepSpeed rank(s), ZeRO-{ln.zero_stage}, "
        f"{'1 GPU each' if cfg.cluster.use_gpus else 'on CPU'}, "
        f"preset {cfg.algorithm.preset}, lr {ln.lr:g}",
        f"weight sync: {cfg.weight_sync.type}",
        f"training: {t.steps} steps x {ln.prompts_per_step} prompts x {r.samples_per_prompt} samples = "
        f"{cfg.samples_per_step} samples per step, max_staleness {t.max_staleness}; held-out evaluation on up to "
        f"{cfg.data.num_eval_prompts} prompts before and after"
        + (f" and every {t.eval_every} steps" if t.eval_every else "")
        + (f"; checkpoints every {t.save_every} steps" if t.save_every else ""),
        f"run folder: {cfg.output_dir} ({logs}, figures in plots/)",
    ]


def dry_run(cfg: RunConfig, node_specs: list[str] | None = None) -> tuple[list[Check], str]:
    """(every check, the report text). The caller exits non-zero when any check is an error."""
    checks = [check_settings(cfg)]
    model_check, tokenizer, cfg = check_model(cfg)
    checks.append(model_check)
    if cfg.gateway.outside_only:  # outside agents bring the tasks; the trainer loads no data set
        checks.append(Check("data", "ok", "none loaded: gateway.outside_only=true trains the sessions outside agents "
                                          "open (RUN/gateway/endpoints.json)"))
    else:
        checks += [check_data(cfg, "train", tokenizer), check_data(cfg, "test", tokenizer)]
    placement_check, plan_text = check_placement(cfg, list(node_specs or []))
    checks.append(placement_check)
    lines = ["dry run: nothing was started", ""]
    lines += [f"[{c.status}] {c.name}: {c.detail}" for c in checks]
    if plan_text:
        lines += ["", "placement:", *("  " + line for line in plan_text.splitlines())]
    lines += ["", "a run with this config would start:", *("  " + line for line in would_start(cfg))]
    errors = sum(c.status == "error" for c in checks)
    lines += ["", f"{errors} error(s): fix them before training" if errors else
              "ready: no errors" + (" (some checks were not possible here)"
                                    if any(c.status != "ok" for c in checks) else "")]
    return checks, "\n".join(lines)
