"""reasoning-gym as a data source (data.format: reasoning_gym): every dataset of the installed library loads by
name and its reward is the library's own `score_answer`, through the reward workers' scorer processes; a mixture
is drawn by weight and resumes where it stopped; metrics split by source."""

import pytest
import reasoning_gym
from pydantic import ValidationError
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer

from actors.prompt_cursor import PromptCursor
from cluster.evaluation import source_accuracy
from demos.task_model import build_task_tokenizer, task_texts
from protocols.data import DataConfig
from protocols.metrics import source_metrics
from protocols.reward import RewardConfig
from protocols.trajectory import Prompt, Trajectory, VerifierResult
from rewards.datasets import load_prompts
from rewards.scorer import Scorer
from rewards.task_library import verify_task
from rewards.task_library_data import eval_counts

EVERY_DATASET = sorted(name for name in DATASETS if name != "composite")  # composite mixes others; it has no default


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    # byte-level: every character of every task encodes, whatever text the merges were learnt from
    return build_task_tokenizer(tmp_path_factory.mktemp("task_tok"), task_texts(["basic_arithmetic", "leg_counting"],
                                                                                size=50))


def _cfg(*tasks: dict, **kw) -> DataConfig:
    return DataConfig(format="reasoning_gym", tasks=list(tasks), max_prompt_tokens=100_000, **kw)


def _answers(entry: dict) -> list[str]:
    """The gold answer in tags, a wrong one, the gold with no tags, and tags around nothing."""
    return [f"thinking <answer>{entry['answer']}</answer>", "<answer>certainly not this</answer>",
            str(entry["answer"]), "<answer></answer>"]


def test_every_reasoning_gym_dataset_loads_by_name_and_its_reward_is_score_answer(tokenizer):
    assert len(EVERY_DATASET) > 100  # the library's whole registry, not a list picked here
    gold_is_full_score = {}
    for name in EVERY_DATASET:
        prompts, counts = load_prompts(_cfg({"name": name, "size": 2, "seed": 5}), "train", tokenizer)
        assert counts["data/loaded"] == 2, name
        dataset = reasoning_gym.create_dataset(name, size=2, seed=5)
        for index, prompt in enumerate(prompts):
            entry = dataset[index]
            assert prompt.metadata["data_source"] == name and prompt.prompt_id == f"{name}/train/{index}"
            assert prompt.prompt_text == entry["question"] and prompt.answer == str(entry["answer"])
            assert tokenizer.decode(prompt.prompt_token_ids, skip_special_tokens=True) == entry["question"]
            for text in _answers(entry):
                try:
                    expected = float(dataset.score_answer(extract_answer(text), entry))
                except Exception as err:  # a scorer that raises on a malformed answer: the scorer counts it
                    with pytest.raises(type(err)):
                        verify_task(prompt, text)
                    continue
                result = verify_task(prompt, text)
                assert result.reward == expected, (name, text)
                assert result.correct == (expected >= 1.0)
        if dataset[0]["answer"] is not None:  # (a task with many right answers, as boxnet's plans, has no oracle)
            gold_is_full_score[name] = verify_task(prompts[0], _answers(dataset[0])[0]).correct
    assert [name for name, full in gold_is_full_score.items() if not full] == [], "the gold answer in tags scores 1"


def test_the_reward_workers_scorer_processes_give_score_answer(tokenizer):
    # the verifier runs where every verifier runs: the scorer's pool processes, under reward.timeout_s
    cfg = _cfg({"name": "chain_sum", "size": 3}, {"name": "leg_counting", "size": 3},
               {"name": "letter_counting", "size": 3, "config": {"min_words": 3, "max_words": 5}})
    prompts, _ = load_prompts(cfg, "train", tokenizer)
    datasets = {t.source: reasoning_gym.create_dataset(t.name, size=t.size, seed=t.seed, **t.config) for t in cfg.tasks}
    responses = [f"<answer>{p.answer}</answer>" if i % 2 else "<answer>0</answer>" for i, p in enumerate(prompts)]
    scorer = Scorer(RewardConfig(verifier="reasoning_gym", num_processes=2))
    try:
        results = scorer.score(prompts, responses)
    finally:
        scorer.close()
    for prompt, response, result in zip(prompts, responses, results):
        entry = prompt.metadata["entry"]
        assert result.error == ""
        assert result.reward == datasets[prompt.metadata["data_source"]].score_answer(extract_answer(response), entry)
    assert [r.correct for r in results][1::2] == [True] * 4


def test_held_out_entries_are_shared_evenly_interleaved_and_never_a_training_question(tokenizer):
    cfg = _cfg({"name": "basic_arithmetic", "size": 30}, {"name": "leg_counting", "size": 30, "weight": 3},
               num_eval_prompts=5)
    train, _ = load_prompts(cfg, "train", tokenizer)
    test, counts = load_prompts(cfg, "test", tokenizer)
    # 5 over 2 tasks: 3 and 2, interleaved task by task
    assert [p.metadata["data_source"] for p in test] == ["basic_arithmetic", "leg_counting"] * 2 + ["basic_arithmetic"]
    assert not {p.prompt_text for p in test} & {p.prompt_text for p in train}
    assert counts["data/loaded"] == 5 and "data/eval_overlap_skipped" in counts
    assert eval_counts(10, 3) == [4, 3, 3]


def test_a_small_task_space_leaves_out_held_out_repeats_of_training_questions(tokenizer):
    # leg_counting with one animal, once, has 37 distinct questions: 2,000 training entries hold them all, so every
    # held-out entry repeats one and none is kept
    cfg = _cfg({"name": "leg_counting", "size": 2000, "config": {"min_animals": 1, "max_animals": 1,
                                                                  "max_instances": 1}}, num_eval_prompts=4)
    test, counts = load_prompts(cfg, "test", tokenizer)
    assert test == [] and counts["data/eval_overlap_skipped"] > 0


def test_a_task_the_library_does_not_know_or_a_config_it_refuses_is_refused_with_the_fix(tokenizer):
    with pytest.raises(ValueError, match="not a reasoning-gym dataset.*basic_arithmetic"):
        load_prompts(_cfg({"name": "basic_arithmetics"}), "train", tokenizer)
    with pytest.raises(ValueError, match="reasoning-gym refused config"):
        load_prompts(_cfg({"name": "chain_sum", "config": {"no_such_field": 1}}), "train", tokenizer)
    with pytest.raises(ValueError, match="set the task's own `size` and `seed`"):
        load_prompts(_cfg({"name": "chain_sum", "config": {"size": 3}}), "train", tokenizer)


def test_the_config_refuses_a_mixture_without_tasks_repeated_labels_and_tasks_for_another_format():
    with pytest.raises(ValidationError, match="needs data.tasks"):
        DataConfig(format="reasoning_gym")
    with pytest.raises(ValidationError, match="more than once"):
        DataConfig(format="reasoning_gym", tasks=[{"name": "chain_sum"}, {"name": "chain_sum"}])
    with pytest.raises(ValidationError, match="does not read it"):
        DataConfig(format="gsm8k", tasks=[{"name": "chain_sum"}])
    with pytest.raises(ValidationError, match="without `/`"):
        DataConfig(format="reasoning_gym", tasks=[{"name": "chain_sum", "label": "a/b"}])
    two = DataConfig(format="reasoning_gym", tasks=[{"name": "chain_sum"}, {"name": "chain_sum", "label": "hard",
                                                                              "weight": 3}])
    assert two.source_weights() == {"chain_sum": 1.0, "hard": 3.0}


def _mixture(sizes: dict[str, int]) -> list[Prompt]:
    return [Prompt(prompt_id=f"{s}/train/{i}", prompt_token_ids=[1], metadata={"data_source": s})
            for s, n in sizes.items() for i in range(n)]


def test_a_mixture_is_drawn_by_weight_within_one_prompt_at_every_point_whatever_the_sizes():
    # weights 1 : 2 : 1 over sources of 5, 50 and 3 prompts: after n draws each has n * w / 4 of them, to within 1
    weights = {"a": 1.0, "b": 2.0, "c": 1.0}
    cursor = PromptCursor(_mixture({"a": 5, "b": 50, "c": 3}), seed=0, weights=weights)
    drawn = {s: 0 for s in weights}
    seen_c = []
    for n in range(1, 401):
        prompt = cursor.next()
        drawn[prompt.metadata["data_source"]] += 1
        if prompt.metadata["data_source"] == "c":
            seen_c.append(prompt.prompt_id)
        for source, weight in weights.items():
            assert abs(drawn[source] - n * weight / 4) <= 1, (n, drawn)
    assert drawn == {"a": 100, "b": 200, "c": 100}
    assert cursor.metrics() == {"data/drawn_a": 100.0, "data/drawn_b": 200.0, "data/drawn_c": 100.0}
    # the small source repeats, reshuffled, once used up: each of its 3 prompts once in every 3 of its draws
    assert all(sorted(seen_c[i:i + 3]) == ["c/train/0", "c/train/1", "c/train/2"] for i in range(0, 99, 3))


def test_a_mixtures_cursor_resumes_where_it_stopped_and_refuses_another_mixture():
    prompts, weights = _mixture({"a": 4, "b": 7}), {"a": 1.0, "b": 1.5}
    first = PromptCursor(prompts, seed=3, weights=weights)
    for _ in range(13):
        first.next()
    resumed = PromptCursor(prompts, seed=3, weights=weights)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.next().prompt_id for _ in range(20)] == [first.next().prompt_id for _ in range(20)]
    with pytest.raises(ValueError, match="resume with the data.tasks it ran with"):
        PromptCursor(_mixture({"a": 4}), seed=3, weights={"a": 1.0}).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="not one of the mixture's sources"):
        PromptCursor(_mixture({"a": 2, "z": 1}), seed=3, weights={"a": 1.0})


def _trajectory(source: str, reward: float, correct: bool, length: int, version: int) -> Trajectory:
    prompt = Prompt(prompt_id=f"{source}/train/0", prompt_token_ids=[1], metadata={"data_source": source})
    return Trajectory(group_id="g", sample_index=0, prompt=prompt, response_token_ids=[5] * length,
                      behavior_logprobs=[0.0] * length, token_versions=[version] * length, finish_reason="stop",
                      reward=reward, result=VerifierResult(reward=reward, correct=correct))


def test_source_metrics_split_the_batch_by_source():
    # a: rewards 1 and 0.5 (one correct), lengths 2 and 4, versions 3 and 2 at version 4 -> staleness 1 and 2
    # b: one sample, reward 0, length 6, version 4
    batch = [_trajectory("a", 1.0, True, 2, 3), _trajectory("a", 0.5, False, 4, 2), _trajectory("b", 0.0, False, 6, 4)]
    metrics = source_metrics(batch, version=4)
    assert metrics["source/a/share"] == pytest.approx(2 / 3) and metrics["source/b/share"] == pytest.approx(1 / 3)
    assert metrics["source/a/reward_mean"] == 0.75 and metrics["source/a/accuracy"] == 0.5
    assert metrics["source/a/length_mean"] == 3.0 and metrics["source/a/staleness_mean"] == 1.5
    assert metrics["source/b/length_mean"] == 6.0 and metrics["source/b/calls_per_sample"] == 0.0
    assert source_metrics([_trajectory("a", 1, True, 1, 0)][:0] or [], 0) == {}
    assert source_accuracy([batch[0].prompt, batch[1].prompt, batch[2].prompt], [True, False, True]) == {
        "eval/a/accuracy": 0.5, "eval/a/samples": 2.0, "eval/b/accuracy": 1.0, "eval/b/samples": 1.0}
