"""The policy's model folder: which one a run uses, and the prompt length it leaves room for."""

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
