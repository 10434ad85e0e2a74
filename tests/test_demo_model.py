"""The demo model: its character tokenizer, the saved Hugging Face folders, the warm start and its cache."""

import json

import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from demos.arithmetic_model import build_random_model, build_tokenizer, prepare_demo_model, warm_start
from demos.model_cache import READY_MARKER, build_cached, default_cache_dir
from demos.warm_start import greedy_accuracy_hf, greedy_responses_hf
from protocols.data import DataConfig
from protocols.model import DemoModelConfig, ModelConfig
from protocols.trajectory import Prompt, VerifierResult
from rewards.arithmetic import verify_arithmetic
from rewards.datasets import load_arithmetic_prompts


def test_tokenizer_encodes_characters_after_bos(tmp_path):
    # ids: pad 0, bos 1, eos 2, digit d -> 3 + d, "+" 13, "=" 14
    tokenizer = build_tokenizer(tmp_path)
    assert tokenizer("12+34=")["input_ids"] == [1, 4, 5, 13, 6, 7, 14]
    assert len(tokenizer) == 15
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_tokenizer_decodes_without_spaces(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    # "5" is 8 and "7" is 10; EOS (2) is dropped as a special token.
    assert tokenizer.decode([8, 10, 2], skip_special_tokens=True) == "57"
    assert tokenizer.decode(tokenizer("120+7=")["input_ids"], skip_special_tokens=True) == "120+7="


def test_auto_tokenizer_of_model_folder_agrees_on_task_text(tiny_models):
    # transformers maps model_type qwen2 to its own Qwen2Tokenizer class (as vLLM's loader does), which rebuilds
    # the pipeline from the vocabulary: it must give the same ids and text on everything the task produces.
    folder = tiny_models["untied"]
    auto = AutoTokenizer.from_pretrained(folder)
    plain = build_tokenizer(folder + "-plain")
    texts = [f"{a}+{b}=" for a in range(0, 100, 7) for b in range(0, 100, 11)] + [str(n) for n in range(199)]
    for text in texts:
        assert auto(text)["input_ids"] == plain(text)["input_ids"], text
    assert auto.decode([4, 12, 11, 2], skip_special_tokens=True) == "198"
    assert auto.eos_token_id == 2 and auto.pad_token_id == 0


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_saved_folder_loads_with_transformers(tiny_models, name):
    model = AutoModelForCausalLM.from_pretrained(tiny_models[name], dtype=torch.float32)
    tied = name == "tied"
    assert model.config.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    # Per layer: q 128*128+128, k and v 128*64+64 each, o 128*128, MLP 3*128*256, two norms 2*128 = 147,968.
    # Two layers 295,936 + embedding 15*128 = 1,920 + final norm 128 = 297,984; untied adds a 1,920 head.
    assert sum(p.numel() for p in model.parameters()) == (297_984 if tied else 299_904)
    with safe_open(f"{tiny_models[name]}/model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) is not tied
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    logits = model(torch.tensor([[1, 4, 5, 13, 6, 7, 14]])).logits
    assert logits.shape == (1, 7, 15) and torch.isfinite(logits).all()


def test_same_seed_builds_the_same_weights(tmp_path):
    a = AutoModelForCausalLM.from_pretrained(build_random_model(tmp_path / "a", tied=False, seed=3))
    b = AutoModelForCausalLM.from_pretrained(build_random_model(tmp_path / "b", tied=False, seed=3))
    c = AutoModelForCausalLM.from_pretrained(build_random_model(tmp_path / "c", tied=False, seed=4))
    torch.testing.assert_close(a.state_dict(), b.state_dict())
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_kv_heads_must_divide_heads(tmp_path):
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of model.demo.num_kv_heads=2"):
        build_random_model(tmp_path, tied=False, heads=3, kv_heads=2)


def test_head_dim_below_32_is_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim=16"):
        build_random_model(tmp_path, tied=False, hidden=32, heads=2, head_dim=16)


def test_left_padding_does_not_change_greedy_responses(tiny_models):
    # A 5-token prompt batched with a 7-token one gets 2 pads on the left; its greedy response must not move.
    folder = tiny_models["untied"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    short = Prompt(prompt_id="s", prompt_token_ids=tokenizer("3+4=")["input_ids"], answer="7")
    long = Prompt(prompt_id="l", prompt_token_ids=tokenizer("31+45=")["input_ids"], answer="76")
    alone = greedy_responses_hf(model, tokenizer, [short])
    batched = greedy_responses_hf(model, tokenizer, [long, short])
    assert batched[1] == alone[0]


def test_greedy_accuracy_counts_verifier_verdicts(tiny_models):
    folder = tiny_models["tied"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts, _ = load_arithmetic_prompts(DataConfig(num_eval_prompts=4), "test", tokenizer)

    def first_two_correct(prompt: Prompt, response: str) -> VerifierResult:
        ok = prompt.prompt_id in ("arithmetic/test/0", "arithmetic/test/1")
        return VerifierResult(reward=float(ok), correct=ok)

    # 2 of 4 marked correct.
    assert greedy_accuracy_hf(folder, tokenizer, prompts, first_two_correct) == 0.5


@pytest.mark.slow
def test_short_warm_start_lifts_greedy_accuracy_above_chance(tmp_path):
    # A random model answers ~0% (it must emit the exact digits then EOS). After 300 steps (about 6 s) the
    # measured held-out accuracy was 8%; the loss falls from ln(15) = 2.7 to about 1.0.
    folder = build_random_model(tmp_path, tied=False, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    data = DataConfig(num_eval_prompts=200)
    test_prompts, _ = load_arithmetic_prompts(data, "test", tokenizer)
    before = greedy_accuracy_hf(folder, tokenizer, test_prompts, verify_arithmetic)
    stats = warm_start(folder, data, steps=300, lr=1e-3, batch=64, seed=0)
    after = greedy_accuracy_hf(folder, tokenizer, test_prompts, verify_arithmetic)
    assert before <= 0.01
    assert after >= 0.03
    assert stats["warm_start/loss_last"] < stats["warm_start/loss_first"] / 2
    assert stats["warm_start/steps"] == 300


def test_warm_start_stops_at_target_accuracy(tmp_path):
    # Target 0: every check meets it, so training stops at the second check, step 2 * 10 = 20.
    folder = build_random_model(tmp_path, tied=True, seed=0)
    stats = warm_start(folder, DataConfig(), steps=1000, lr=1e-3, batch=8, seed=0, target_accuracy=0.0)
    assert stats["warm_start/steps"] == 20


def test_prepare_demo_model_reuses_the_cached_folder(tmp_path):
    demo = DemoModelConfig(warm_start_steps=3, warm_start_batch=4)
    first = prepare_demo_model(tmp_path, demo, evaluate=False)
    marker = tmp_path / first.split("/")[-1] / READY_MARKER
    written = marker.stat().st_mtime_ns
    assert prepare_demo_model(tmp_path, demo, evaluate=False) == first
    assert marker.stat().st_mtime_ns == written
    assert json.loads(marker.read_text())["warm_start/steps"] == 3
    # Only the finished folder is left in the cache: the temporary build folder was renamed into place.
    assert [p.name for p in tmp_path.iterdir()] == [first.split("/")[-1]]


def test_prepare_demo_model_rebuilds_a_folder_without_marker(tmp_path):
    demo = DemoModelConfig(warm_start_steps=2, warm_start_batch=4)
    first = prepare_demo_model(tmp_path, demo, evaluate=False)
    (tmp_path / first.split("/")[-1] / READY_MARKER).unlink()
    assert prepare_demo_model(tmp_path, demo, evaluate=False) == first
    assert (tmp_path / first.split("/")[-1] / READY_MARKER).is_file()


def test_build_runs_on_one_thread_and_restores_the_count(tmp_path):
    torch.set_num_threads(2)
    seen = []
    folder = build_cached(tmp_path, "k", lambda tmp: seen.append(torch.get_num_threads()) or {})
    # the build saw one thread (spinning threads on a busy machine cost 6 to 8x); the caller's count is back
    assert seen == [1] and torch.get_num_threads() == 2
    assert json.loads((tmp_path / "k" / READY_MARKER).read_text()).keys() == {"warm_start/total_seconds"}
    assert folder == str(tmp_path / "k")


def test_other_settings_get_another_cache_folder(tmp_path):
    a = prepare_demo_model(tmp_path, DemoModelConfig(warm_start_steps=2, warm_start_batch=4), evaluate=False)
    b = prepare_demo_model(tmp_path, DemoModelConfig(warm_start_steps=2, warm_start_batch=4, seed=1), evaluate=False)
    assert a != b


def test_cache_dir_comes_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAYRL_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("RELAYRL_CACHE_DIR")
    assert default_cache_dir().parts[-3:] == (".cache", "relayrl", "demo_models")


def test_model_configs_forbid_unknown_fields():
    with pytest.raises(ValidationError):
        DemoModelConfig(hiden_size=64)
    with pytest.raises(ValidationError):
        ModelConfig(pth="/models/x")
    assert ModelConfig().path == "" and ModelConfig().demo.head_dim == 64
