"""`relayrl eval`: the evaluation harness on the real stack (vLLM generation, reward worker actors), and its
refusals of bad input before anything starts."""

import json
from pathlib import Path

import pytest

from cli.main import main

REPO = Path(__file__).resolve().parents[1]


def _eval(tmp_path: Path, *args: str) -> int:
    return main(["eval", "--output-dir", str(tmp_path / "out"), *args])


@pytest.mark.slow
def test_eval_on_the_demo_model_reports_monotone_pass_at_k_and_every_generation(ray_cluster, tmp_path, capsys):
    # 24 held-out problems, greedy plus K=4 samples each at temperature 0.6, top-p 0.95 (train.eval_*)
    assert _eval(tmp_path, "--model", "demo", "--data", "demo", "--samples", "4", "--num-prompts", "24") == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out) == summary
    assert summary["temperature"] == 0.6 and summary["top_p"] == 0.95
    assert summary["prompts"] == 24 and summary["samples_per_prompt"] == 4 and summary["errors"] == {}
    passes = [summary["pass_at_k"][k] for k in ("1", "2", "4")]
    assert passes == sorted(passes) and 0 <= passes[0] and passes[-1] <= 1
    # the warm start stops near 45% greedy accuracy; sampling at 0.6 keeps most mass near the mode, so
    # pass@1 sits near (here: within 0.25 of) the greedy accuracy, and pass@4 at or above pass@1
    assert 0.2 <= summary["greedy_accuracy"] <= 0.8
    assert abs(passes[0] - summary["greedy_accuracy"]) <= 0.25, summary
    rows = [json.loads(x) for x in (tmp_path / "out" / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 24 * (1 + 4)
    keys = {"set", "prompt_id", "sample", "response", "tokens", "finish_reason", "gold", "extracted", "reward",
            "correct", "error"}
    assert all(set(r) == keys for r in rows)
    assert {r["sample"] for r in rows} == {-1, 0, 1, 2, 3}
    assert len({r["prompt_id"] for r in rows}) == 24
    # the arithmetic verifier's reading of each answer, and the summary recomputed from the rows
    assert all(r["extracted"] == r["response"].strip() and r["correct"] == (r["extracted"] == r["gold"]) for r in rows)
    greedy = [r for r in rows if r["sample"] == -1]
    assert sum(r["correct"] for r in greedy) / 24 == pytest.approx(summary["greedy_accuracy"])
    sampled = [r for r in rows if r["sample"] >= 0]
    assert sum(r["correct"] for r in sampled) / len(sampled) == pytest.approx(passes[0])


def test_a_folder_that_is_not_a_hf_model_is_named(tmp_path, capsys):
    data = ["--data", "demo", "--samples", "2"]
    assert _eval(tmp_path, "--model", str(tmp_path / "nowhere"), *data) == 2
    assert "nowhere" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _eval(tmp_path, "--model", str(empty), *data) == 2
    assert f"{empty / 'config.json'}: missing" in capsys.readouterr().err
    # config.json that is not JSON: the line of the fault
    (empty / "config.json").write_text('{\n  "model_type": "qwen2",\n  oops\n}\n')
    assert _eval(tmp_path, "--model", str(empty), *data) == 2
    assert f"{empty / 'config.json'}:3: not valid JSON" in capsys.readouterr().err
    # JSON without the field that names the architecture
    (empty / "config.json").write_text('{"hidden_size": 8}\n')
    assert _eval(tmp_path, "--model", str(empty), *data) == 2
    assert "no field 'model_type'" in capsys.readouterr().err
    (empty / "config.json").write_text('{"model_type": "qwen2"}\n')
    assert _eval(tmp_path, "--model", str(empty), *data) == 2
    assert "no weights" in capsys.readouterr().err


def test_a_data_file_missing_the_mapped_field_names_path_line_and_field(tiny_models, tmp_path, capsys):
    data = tmp_path / "held_out.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "gold": "2"}) + "\n" + json.dumps({"question": "2+2="}) + "\n")
    code = _eval(tmp_path, "--model", tiny_models["untied"], "--data", str(data), "--samples", "2",
                 "--field", "prompt=question", "--field", "answer=gold")
    err = capsys.readouterr().err
    assert code == 2
    assert f"{data}:2" in err and "'gold'" in err
    # a mapping key the harness does not know
    assert _eval(tmp_path, "--model", tiny_models["untied"], "--data", str(data), "--field", "label=gold") == 2
    assert "KEY one of" in capsys.readouterr().err
    # neither a built-in set nor a file
    assert _eval(tmp_path, "--model", tiny_models["untied"], "--data", "mmlu") == 2
    assert "neither a built-in set" in capsys.readouterr().err


def test_longcot_set_and_demo_model_follow_the_config(monkeypatch):
    """`--data longcot` is the long-CoT task's held-out set with its verifier; `--model demo` under a long-CoT config
    resolves to the long-CoT model's builder, not the addition demo's (both cached builds are slow, so recorded)."""
    import demos.longcot_model
    from cluster.evaluation import eval_data_config
    from cluster.model_folder import resolve_model_path
    from protocols.config import load_config

    cfg = load_config(str(REPO / "deploy" / "configs" / "demo_longcot.yaml"))
    name, data, verifier = eval_data_config("longcot", cfg.data.model_copy(update={"format": "arithmetic"}))
    assert (name, data.format, verifier) == ("longcot", "longcot", "longcot")
    calls = []
    monkeypatch.setattr(demos.longcot_model, "prepare_longcot_model", lambda **kw: calls.append(kw) or "/m")
    assert resolve_model_path(cfg) == "/m" and calls[0]["demo"] == cfg.model.demo
