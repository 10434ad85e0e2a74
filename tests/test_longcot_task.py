"""The long chain-of-thought demo task: its problems and their length tail, the verifier, the tokenizer, the warm
start's micro-batches and its refusal to hand over a model below target."""

import statistics

import pytest

from demos.longcot_model import (
    WarmStartFailed,
    build_longcot_random_model,
    build_longcot_tokenizer,
    micro_batches,
    solution_rows,
    warm_start_longcot,
)
from protocols.data import DataConfig
from protocols.model import DemoModelConfig
from protocols.trajectory import Prompt
from rewards.datasets import load_prompts
from rewards.longcot import verify_longcot
from rewards.longcot_data import final_answer, longcot_problems, pair_split, solution_text
from rewards.registry import resolve_verifier


def _response_lengths(cfg: DataConfig) -> list[int]:
    # Response tokens = one per character of the solution, plus EOS.
    pairs = longcot_problems("train", cfg.longcot_num_train, long_fraction=cfg.longcot_long_fraction,
                             max_b=cfg.longcot_max_b)
    return sorted(len(solution_text(a, b)) + 1 for a, b in pairs)


def test_solution_is_repeated_addition_then_the_answer():
    # 12*3: 0+12=12, 12+12=24, 24+12=36, then the product after '#'
    assert solution_text(12, 3) == "1:0+12=12;2:12+12=24;3:24+12=36;#36"


def test_training_mix_has_a_long_tail_of_response_lengths():
    lengths = _response_lengths(DataConfig(format="longcot"))
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * len(lengths))]
    # the shape: median >= 100, p99 >= 6x median, longest >= 1,024
    assert median >= 100
    assert p99 >= 6 * median
    assert lengths[-1] >= 1024


def test_no_long_fraction_removes_the_tail():
    lengths = _response_lengths(DataConfig(format="longcot", longcot_long_fraction=0.0, longcot_num_train=2000))
    # b <= 14 with two-digit a: at most 14 steps of at most 15 characters, plus '#', 4 digits and EOS
    assert lengths[-1] <= 14 * 15 + 6


def test_held_out_problems_are_distinct_and_never_trained_on():
    train = set(longcot_problems("train", 20_000, long_fraction=0.08, max_b=72))
    test = longcot_problems("test", 200, long_fraction=0.08, max_b=72)
    assert len(set(test)) == 200
    assert not train & set(test)
    assert all(pair_split(a, b) == "test" for a, b in test)


def _prompt(a: int, b: int) -> Prompt:
    return Prompt(prompt_id="longcot/test/0", prompt_token_ids=[1], prompt_text=f"{a}*{b}=", answer=str(a * b))


def test_verifier_reads_only_the_final_answer():
    prompt = _prompt(12, 3)
    # wrong working, right answer: correct; right working, wrong answer: not
    assert verify_longcot(prompt, "1:0+12=99;2:5+5=7;#36").reward == 1.0
    assert verify_longcot(prompt, "1:0+12=12;2:12+12=24;3:24+12=36;#35").reward == 0.0
    # the last '#' counts; spaces around the answer do not
    assert verify_longcot(prompt, "#35;#36 ").correct


def test_verifier_gives_nothing_without_an_answer_mark():
    prompt = _prompt(12, 3)
    # cut off while still working (the product appears, but never after '#')
    assert verify_longcot(prompt, "1:0+12=12;2:12+12=24;3:24+12=36").reward == 0.0
    assert final_answer("1:0+12=12;") == ""
    assert verify_longcot(prompt, "#").reward == 0.0


def test_verifier_is_registered_as_longcot():
    assert resolve_verifier("longcot").fn is verify_longcot


def test_tokenizer_round_trips_a_solution(tmp_path):
    tokenizer = build_longcot_tokenizer(tmp_path)
    text = "37*12=" + solution_text(37, 12)
    ids = tokenizer(text)["input_ids"]
    # one token per character, BOS in front; decoding gives the text back
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_loader_makes_longcot_prompts(tmp_path):
    tokenizer = build_longcot_tokenizer(tmp_path)
    cfg = DataConfig(format="longcot", num_eval_prompts=20)
    prompts, counts = load_prompts(cfg, "test", tokenizer)
    assert counts == {"data/loaded": 20, "data/skipped_too_long": 0}
    p = prompts[0]
    a, b = p.metadata["a"], p.metadata["b"]
    assert p.prompt_text == f"{a}*{b}=" and p.answer == str(a * b)
    assert verify_longcot(p, solution_text(a, b)).correct
    # Length-aware dispatch's hint: the written-out solution's characters + EOS, from a and b alone; for 12*3 that is
    # "1:0+12=12;2:12+12=24;3:24+12=36;#36" (35 characters) + 1 = 36.
    assert all(q.metadata["length_hint"] == len(solution_text(q.metadata["a"], q.metadata["b"])) + 1 for q in prompts)


def test_micro_batches_keep_every_row_once_under_the_token_budget(tmp_path):
    tokenizer = build_longcot_tokenizer(tmp_path)
    pairs = [(12, 2), (12, 60), (34, 3), (56, 5), (78, 40)]
    rows = solution_rows(pairs, tokenizer)
    batches = list(micro_batches(rows, max_tokens=1000, pad_id=0))
    # the padded size stays under the budget unless one row alone is longer than it
    assert all(ids.numel() <= 1000 or ids.shape[0] == 1 for ids, _ in batches)
    targets = sorted(int(mask.sum()) for _, mask in batches for mask in mask)
    assert targets == sorted(len(ids) - start for ids, start in rows)


def test_warm_start_below_its_target_refuses(tmp_path):
    # one step from random weights cannot solve anything; short problems keep the check fast
    demo = DemoModelConfig(max_position_embeddings=128, warm_start_steps=1, warm_start_batch=4,
                           warm_start_target_accuracy=0.5)
    data = DataConfig(format="longcot", longcot_max_b=3, longcot_long_fraction=0.0, longcot_num_train=50)
    build_longcot_random_model(tmp_path, demo)
    with pytest.raises(WarmStartFailed, match="model.demo.warm_start_target_accuracy=0.5"):
        warm_start_longcot(tmp_path, data, demo, num_check_problems=8)


def test_dry_run_reads_the_longcot_task_with_its_own_tokenizer(tmp_path):
    from cli.dry_run import check_data
    from protocols.config import RunConfig

    cfg = RunConfig(data=DataConfig(format="longcot", num_eval_prompts=10))
    check = check_data(cfg, "test", build_longcot_tokenizer(tmp_path))
    # 10 distinct held-out prompts, each a*b= in characters the tokenizer knows
    assert check.status == "ok" and "10 generated problems" in check.detail
