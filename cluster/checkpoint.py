"""Checkpoints of a run: their layout, the atomic write, the `latest` pointer, pruning, and the checks made
before `relayrl train --resume RUN_DIR` continues a run.

    RUN_DIR/checkpoints/
      step_000010/          one complete checkpoint, renamed from step_000010.tmp once every piece is written
        policy/             the policy in Hugging Face format (serving, evaluation)
        learner/            DeepSpeed checkpoint (tag `ds`: weights, optimizer partitions of every rank) and
                            rng_rank{r}.pt (python, numpy and torch RNG states of rank r)
        critic/             with a critic (ppo), the same for its ranks (learner/rank_checkpoint.py), its version
                            in the DeepSpeed checkpoint's client state
        state.json          driver and controller state: policy version, metrics step, trained group ids, data
                            cursor, queued groups, counters, admission accounting, the groups in flight
        config.yaml         the resolved config of the run that wrote it
        manifest.json       written last inside the temporary folder: every file and its size
      latest                the name of the newest complete checkpoint, replaced (tmp + os.replace) after the rename

A crash at any point leaves either a `*.tmp` folder (ignored, removed by the next save) or a complete folder; the
last good checkpoint is only removed by pruning, after a newer one is complete and `latest` names it.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
REQUIRED = ("state.json", "config.yaml", "policy/config.json", "learner", MANIFEST)
"""Pieces every complete checkpoint holds (manifest.json then lists every file)."""

SHAPE_SETTINGS = (
    "model.path", "model.demo", "model.dtype", "model.lora",
    "rollout.samples_per_prompt",
    "learner.num_ranks", "learner.zero_stage", "learner.sequence_parallel_size", "learner.prompts_per_step",
    "critic.num_workers", "critic.model_path", "critic.zero_stage",
    "train.seed",
    "data.format", "data.train_path", "data.prompt_field", "data.answer_field", "data.tests_field",
    "data.prompt_template", "data.system_prompt", "data.use_chat_template", "data.max_prompt_tokens",
    "data.arithmetic_max_operand", "data.arithmetic_num_train", "data.arithmetic_min_operand", "data.arithmetic_op",
    "data.longcot_num_train", "data.longcot_long_fraction", "data.longcot_max_b",
)
"""Settings a resumed run must share with its checkpoint: they fix the shapes of the weights and the optimizer
partitions (model, dtype, ranks, ZeRO stage; the critic's too), the group size and batch the queue and admission accounting count
in, and the training prompts and their order (the data cursor is a position in them). Everything else (steps,
learning rate, logging, evaluation, workers) may change on resume."""

MODEL_SHAPE_KEYS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
"""Keys of the policy's config.json that fix the parameter shapes."""


class CheckpointError(ValueError):
    """A resume that cannot go on: no complete checkpoint, or one written under settings that change shapes."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(folder: Path) -> int | None:
    """The step of a checkpoint folder named step_N, None for anything else (a `.tmp` folder included)."""
    name = folder.name
    if not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _manifest(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def save(run_dir: str | Path, step: int, keep: int, write_pieces: Callable[[Path], None]) -> Path:
    """Write checkpoint `step`: `write_pieces(folder)` fills a fresh temporary folder, then the manifest is written,
    the folder renamed into place, `latest` replaced, and all but the newest `keep` complete checkpoints removed
    (with any leftover temporary folders). Returns the checkpoint's folder."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_name(step)
    tmp = root / (final.name + TMP_SUFFIX)
    if tmp.exists():  # left by a crash during an earlier write of the same step
        shutil.rmtree(tmp)
    tmp.mkdir()
    write_pieces(tmp)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": _manifest(tmp)}, indent=1))
    if final.exists():
        # An incomplete folder of this step (a complete one would have been the resume point): replace it.
        shutil.rmtree(final)
    os.rename(tmp, final)
    _write_text_atomic(root / LATEST, final.name + "\n")
    prune(run_dir, keep)
    return final


def prune(run_dir: str | Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` complete checkpoints, never the one `latest` names, and every temporary
    folder (a save in progress is never running here: the driver saves between steps). Returns what went."""
    root = checkpoints_dir(run_dir)
    latest = read_latest(run_dir)
    complete = sorted((p for p in root.iterdir() if step_of(p) is not None and not missing_pieces(p)), key=step_of)
    doomed = [p for p in complete[:-keep] if p != latest]
    doomed += [p for p in root.iterdir() if p.is_dir() and p.name.endswith(TMP_SUFFIX)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def read_latest(run_dir: str | Path) -> Path | None:
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    return checkpoints_dir(run_dir) / pointer.read_text().strip()


def missing_pieces(folder: Path) -> list[str]:
    """What a checkpoint folder lacks (empty: complete): required pieces, then files the manifest lists that are
    gone or have another size."""
    if not folder.is_dir():
        return [f"the folder {folder.name} itself"]
    missing = [piece for piece in REQUIRED if not (folder / piece).exists()]
    if MANIFEST in missing:
        return missing
    listed = json.loads((folder / MANIFEST).read_text())["files"]
    for rel, size in listed.items():
        path = folder / rel
        if not path.is_file():
            missing.append(rel)
        elif path.stat().st_size != size:
            missing.append(f"{rel} (size {path.stat().st_size}, manifest says {size})")
    return missing


def find_resume_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of a run folder: the highest step_N whose pieces are all there. That is the
    one `latest` names, unless a crash came between a checkpoint's rename and the pointer's update (the renamed
    folder is complete, so it wins). Raises CheckpointError naming the folder and what is missing."""
    run_dir = Path(run_dir)
    root = checkpoints_dir(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such folder; give the output_dir of an earlier run")
    if not root.is_dir():
        raise CheckpointError(
            f"--resume {run_dir}: no complete checkpoint: the folder has no {CHECKPOINTS}/ subfolder (runs write "
            "checkpoints only with train.save_every > 0)")
    latest = read_latest(run_dir)
    candidates = sorted((p for p in root.iterdir() if step_of(p) is not None), key=step_of, reverse=True)
    for folder in candidates:
        if not missing_pieces(folder):
            return folder
    problems = [f"{LATEST} pointer missing" if latest is None else
                f"{LATEST} names {latest.name}, which is incomplete"]
    problems += [f"{p.name} lacks {', '.join(missing_pieces(p))}" for p in candidates]
    if not candidates:
        problems.append("no step_N folder (only unfinished *.tmp ones, if any)")
    raise CheckpointError(f"--resume {run_dir}: no complete checkpoint in {root}: " + "; ".join(problems))


def read_state(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "state.json").read_text())


def _dotted(tree: dict, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def differing_settings(saved: dict, new: dict, keys: tuple[str, ...] = SHAPE_SETTINGS) -> list[tuple[str, Any, Any]]:
    """(setting, checkpoint's value, new value) for every shape setting that differs between two config trees."""
    return [(key, _dotted(saved, key), _dotted(new, key)) for key in keys if _dotted(saved, key) != _dotted(new, key)]


def model_shape(model_path: str | Path) -> dict[str, Any]:
    """The parameter-shaping fields of a Hugging Face folder's config.json."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return {key: config.get(key) for key in MODEL_SHAPE_KEYS}


def check_compatible(folder: Path, new_config: dict, new_model_path: str | Path) -> None:
    """Refuse a resume whose config changes shapes: compares the checkpoint's resolved config (config.yaml) and
    its policy's architecture (policy/config.json) with the new ones, naming every differing setting."""
    import yaml

    saved = yaml.safe_load((folder / "config.yaml").read_text())
    diffs = differing_settings(saved, new_config)
    saved_model, new_model = model_shape(folder / "policy"), model_shape(new_model_path)
    diffs += [(f"model architecture `{key}` (config.json)", saved_model[key], new_model[key])
              for key in MODEL_SHAPE_KEYS if saved_model[key] != new_model[key]]
    if diffs:
        lines = "\n  ".join(f"{key}: checkpoint {old!r}, now {now!r}" for key, old, now in diffs)
        raise CheckpointError(
            f"--resume from {folder}: the new config changes settings that fix the shapes of the saved state:\n  "
            f"{lines}\nResume with the checkpoint's values (drop these overrides, or omit --config to reuse the "
            "run's config.yaml), or start a new run in another output_dir")
