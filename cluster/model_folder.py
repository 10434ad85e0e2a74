"""The policy's model folder: which one a run uses, the prompt length it leaves room for, and whether another
role's model (a critic, a teacher) reads the same token ids."""

import json
import logging
from pathlib import Path

from protocols.config import RunConfig

log = logging.getLogger(__name__)


def resolve_model_path(cfg: RunConfig) -> str:
    """The policy's HF folder: `model.path`, or the cached warm-started demo model (the long-CoT one for
    `data.format: longcot`)."""
    if cfg.model.path:
        if not (Path(cfg.model.path) / "config.json").is_file():
            raise ValueError(
                f"model.path={cfg.model.path!r} is not a Hugging Face model folder (no config.json there); give a "
                "local folder with config.json, weights and tokenizer, or leave model.path empty for the demo model"
            )
        return cfg.model.path
    if cfg.data.format == "longcot":  # the long chain-of-thought demo's own model and cache key
        from demos.longcot_model import prepare_longcot_model

        return prepare_longcot_model(demo=cfg.model.demo, data=cfg.data, log=log.info)
    from demos.arithmetic_model import prepare_demo_model

    return prepare_demo_model(demo=cfg.model.demo, data=cfg.data, tools=cfg.tools)


def fit_lengths_to_model(cfg: RunConfig, model_path: str) -> RunConfig:
    """Prompt + response must fit the model's context; shrink data.max_prompt_tokens to fit, or fail early."""
    model_cfg = json.loads((Path(model_path) / "config.json").read_text())
    limit = model_cfg.get("max_position_embeddings")
    if not limit or cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens <= limit:
        return cfg
    room = limit - cfg.rollout.max_response_tokens
    if room < 1:
        raise ValueError(
            f"rollout.max_response_tokens={cfg.rollout.max_response_tokens} leaves no room for a prompt in the "
            f"model's context of {limit} tokens (max_position_embeddings in {model_path}/config.json); lower it"
        )
    log.warning("data.max_prompt_tokens=%d lowered to %d to fit the model's context of %d tokens",
                cfg.data.max_prompt_tokens, room, limit)
    return cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_prompt_tokens": room})})


def check_same_vocabulary(setting: str, role: str, policy_path: str, other_path: str, trust_remote_code: bool,
                          fix: str) -> None:
    """Raise ValueError when `other_path` (the folder `setting` names, for `role`) is not a Hugging Face model
    folder, or its tokenizer (token -> id map, special tokens) or vocabulary size differs from the policy's: a
    role that scores the policy's token ids would silently score other tokens. `fix`: what the user can do."""
    if Path(other_path).resolve() == Path(policy_path).resolve():
        return
    if not (Path(other_path) / "config.json").is_file():
        raise ValueError(f"{setting}={other_path!r} is not a Hugging Face model folder (no config.json there): "
                         f"{fix}")
    from transformers import AutoTokenizer

    vocab = {}
    for path in (policy_path, other_path):
        size = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise ValueError(f"{setting}={other_path!r}: no tokenizer could be loaded from {path!r} ({err}); the "
                             f"{role} folder needs the policy's tokenizer (model at {policy_path!r})") from None
        specials = {k: getattr(tok, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        vocab[path] = (size, tok.get_vocab(), specials)
    (p_size, p_vocab, p_special), (o_size, o_vocab, o_special) = vocab[policy_path], vocab[other_path]
    problems = []
    if p_size != o_size:
        problems.append(f"vocab_size {o_size} in the {role}'s config.json against {p_size} in the policy's")
    if p_vocab != o_vocab:
        differ = sorted(set(p_vocab.items()) ^ set(o_vocab.items()))[:3]
        problems.append(f"tokenizers map tokens to different ids ({len(o_vocab)} tokens against {len(p_vocab)}; "
                        f"for example {differ})")
    if p_special != o_special:
        problems.append(f"special token ids {o_special} against the policy's {p_special}")
    if problems:
        raise ValueError(
            f"{setting}={other_path!r} does not share the policy's vocabulary (policy model: {policy_path!r}): "
            + "; ".join(problems) + f". The {role} reads the policy's token ids: {fix}")
