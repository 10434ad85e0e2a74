"""LoRA's side of the weights (model.lora.rank > 0), shared by the learner ranks and the rollout engines: the peft
config both build from `model.lora`, which parameters are the adapter and their names in peft's saved format (what
every transport sends, in place of the full weights), the adapter folder vLLM loads, and the merged model written
into checkpoints and final_model/. peft and safetensors are imported inside the functions.

Names: a live peft parameter `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` travels as
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` (peft's `adapter_model.safetensors` naming, which
vLLM reads); the base model's own weights never leave the learner.
"""

import json
import shutil
from pathlib import Path

import torch

from protocols.lora import LoraConfig

ADAPTER_NAME = "default"
"""peft's name of the one adapter the learner trains."""

ADAPTER_SUBFOLDER = "adapter"
"""Where a saved policy (a checkpoint's policy/, final_model/) keeps the adapter in peft format, beside the merged
model."""


def peft_config(lora: LoraConfig, base_model_path: str | None = None):
    """The peft `LoraConfig` of `model.lora` (no bias, causal LM); the learner wraps its model with it and the
    adapter folders carry it as adapter_config.json."""
    import peft

    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
                           base_model_name_or_path=base_model_path)


def is_adapter_param(name: str) -> bool:
    """Whether a live parameter name of a peft model is the adapter's (its A or B matrix)."""
    return f".{ADAPTER_NAME}." in name and (".lora_A." in name or ".lora_B." in name)


def saved_name(name: str) -> str:
    """A live adapter parameter's name in peft's saved format (the adapter name dropped)."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(saved name, live parameter) of every adapter matrix of a peft model, in a fixed order: what a weight sync
    sends."""
    return [(saved_name(name), param) for name, param in model.named_parameters() if is_adapter_param(name)]


def write_adapter(folder: str | Path, weights: list[tuple[str, torch.Tensor]], lora: LoraConfig,
                  base_model_path: str | None = None) -> Path:
    """Write an adapter in peft format: adapter_model.safetensors (the saved-name tensors) and
    adapter_config.json. What vLLM's `add_lora` and peft's `PeftModel.from_pretrained` both load."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().to("cpu").contiguous() for name, tensor in weights},
              str(folder / "adapter_model.safetensors"))
    peft_config(lora, base_model_path).save_pretrained(str(folder))
    return folder


def zero_adapter(model_path: str, lora: LoraConfig, trust_remote_code: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The adapter of policy version 0 with every matrix zero: the base model's own outputs, which is what
    peft's initial adapter gives too (its B starts at zero). Built on the meta device from the config alone."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = get_peft_model(AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code),
                               peft_config(lora))
    return [(name, torch.zeros(param.shape, dtype=torch.float32)) for name, param in adapter_params(model)]


def merged_state_dict(model: torch.nn.Module, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The base model's weights with the adapter merged in (W + alpha/r * B @ A), under the base model's own
    checkpoint names, as host copies: a folder transformers and vLLM load without peft. `model` is the peft
    model with its parameters whole (gathered under ZeRO-3). `only`: just these entries of the base model's
    state dict (its live names, `...q_proj.base_layer.weight`), whose parameters and adapter matrices are the
    whole ones (a bucket of a gather)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {f"{name}.weight": module.get_delta_weight(ADAPTER_NAME)
              for name, module in base.named_modules()
              if isinstance(module, LoraLayer) and (only is None or f"{name}.base_layer.weight" in only)}
    out = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or (only is not None and name not in only):
            continue
        name = name.replace(".base_layer.", ".")
        tensor = tensor.detach()
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        out[name] = tensor.to("cpu").clone()
    return out


def save_merged(folder: str | Path, model: torch.nn.Module, merged: dict[str, torch.Tensor]) -> None:
    """Write `merged` (merged_state_dict) as a Hugging Face folder with the base model's config. A tied model
    keeps one copy of the shared matrix (transformers ties lm_head back on load)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.get_base_model().config
    if getattr(config, "tie_word_embeddings", False):
        merged = {k: v for k, v in merged.items() if k != "lm_head.weight"}
    save_file(merged, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    generation = getattr(model.get_base_model(), "generation_config", None)
    if generation is not None:
        generation.save_pretrained(str(folder))


class AdapterFolders:
    """A rollout worker's adapter folders, one per loaded version under a temporary folder of its own (vLLM
    loads adapters from disk only). The folder of the version the engine holds stays until a newer one is loaded;
    older ones are removed."""

    def __init__(self, root: str | Path, lora: LoraConfig, base_model_path: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lora = lora
        self.base_model_path = base_model_path
        self.written: list[Path] = []

    def write(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> Path:
        """Write `version`'s adapter into a folder of its own (a version written twice, e.g. after a resume,
        overwrites its folder) and return it."""
        folder = self.root / f"v{version:08d}"
        if folder.exists():
            shutil.rmtree(folder)
        write_adapter(folder, weights, self.lora, self.base_model_path)
        self.written.append(folder)
        return folder

    def loaded(self, folder: Path) -> None:
        """The engine holds the adapter in `folder`: remove every older folder."""
        for old in [f for f in self.written if f != folder]:
            shutil.rmtree(old, ignore_errors=True)
        self.written = [folder]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def adapter_num_bytes(folder: str | Path) -> int:
    """Bytes of the tensors in an adapter folder (its safetensors header says each tensor's offsets)."""
    path = Path(folder) / "adapter_model.safetensors"
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(end - start for key, value in header.items() if key != "__metadata__"
               for start, end in [value["data_offsets"]])
