"""weights/lora.py against peft itself, on the tiny demo model (plain torch, no Ray, vLLM or DeepSpeed): the adapter a
sync sends is peft's saved adapter, the zero adapter of version 0 is the base model, and the merged model equals
peft's own merge."""

import torch

from protocols.lora import LoraConfig
from weights.lora import (
    AdapterFolders,
    adapter_num_bytes,
    adapter_params,
    merged_state_dict,
    peft_config,
    save_merged,
    write_adapter,
    zero_adapter,
)

LORA = LoraConfig(rank=4, alpha=8)


def _peft_model(path: str, trained: bool = True):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), peft_config(LORA))
    if trained:  # B starts at zero; give it values so the adapter changes the outputs
        torch.manual_seed(3)
        for _, param in adapter_params(model):
            param.data.normal_(0, 0.05)
    return model


def test_adapter_params_are_peft_saved_adapter(tiny_models):
    from peft import get_peft_model_state_dict

    model = _peft_model(tiny_models["tied"])
    sent = dict(adapter_params(model))
    saved = get_peft_model_state_dict(model)
    assert sorted(sent) == sorted(saved)
    # 2 layers x 7 projections x (A, B) = 28 tensors; only they train
    assert len(sent) == 28
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_" in n}
    for name, tensor in saved.items():
        torch.testing.assert_close(sent[name].detach(), tensor, rtol=0, atol=0)


def test_zero_adapter_has_the_shapes_of_the_trained_one(tiny_models):
    zero = dict(zero_adapter(tiny_models["untied"], LORA))
    live = {name: param.shape for name, param in adapter_params(_peft_model(tiny_models["untied"]))}
    assert {name: t.shape for name, t in zero.items()} == live
    assert all(float(t.abs().sum()) == 0.0 for t in zero.values())


def test_written_adapter_loads_in_peft_with_the_same_outputs(tiny_models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = _peft_model(tiny_models["tied"]).eval()
    folder = write_adapter(tmp_path / "a", [(n, p.detach()) for n, p in adapter_params(model)], LORA,
                           tiny_models["tied"])
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["tied"]), str(folder)).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    # 28 fp32 matrices of rank 4: per layer q (4x128 + 128x4), k and v (4x128 + 64x4 each: one KV head of 64),
    # o (4x128 + 128x4), gate and up (4x128 + 256x4), down (4x256 + 128x4), all x 4 bytes
    per_layer = (1024 + 768 + 768 + 1024 + 1536 + 1536 + 1536) * 4
    assert adapter_num_bytes(folder) == 2 * per_layer == sum(p.numel() * 4 for _, p in adapter_params(model))


def test_merged_model_equals_peft_merge_and_loads_in_transformers(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    for kind in ("tied", "untied"):
        model = _peft_model(tiny_models[kind]).eval()
        merged = merged_state_dict(model)
        save_merged(tmp_path / kind, model, merged)
        reference = _peft_model(tiny_models[kind]).merge_and_unload().state_dict()
        for name, tensor in reference.items():
            torch.testing.assert_close(merged[name], tensor)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / kind), dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_adapter_folders_keep_only_the_loaded_version(tmp_path):
    folders = AdapterFolders(tmp_path / "adapters", LORA, "base")
    weights = [("base_model.model.x.lora_A.weight", torch.zeros(4, 8))]
    first = folders.write(1, weights)
    folders.loaded(first)
    second = folders.write(2, weights)
    assert first.exists() and second.exists()  # the engine still holds version 1 until 2 is loaded
    folders.loaded(second)
    assert not first.exists() and second.exists()
    folders.close()
    assert not (tmp_path / "adapters").exists()
