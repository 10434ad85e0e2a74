"""The rollout-efficiency benchmark's own pieces (benchmarks/rollout_efficiency.py), without an engine: the forced
lengths of the baseline's requests, the step interleaving and its time split, the ratio summary."""

from types import SimpleNamespace

import benchmarks.rollout_efficiency as bench
from benchmarks.rollout_efficiency import forced_length_params, interleaved, ratio_summary


class _Clock:
    """A clock that moves only when a step 'runs': the time split is then exact, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def read(self) -> float:
        return self.now


def test_forced_length_params_generate_exactly_the_length_and_keep_the_seed():
    from vllm import SamplingParams

    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=1200, logprobs=0, seed=7)
    forced = forced_length_params(params, 37)
    assert (forced.max_tokens, forced.ignore_eos) == (37, True)
    assert (forced.seed, forced.temperature, forced.logprobs) == (7, 1.0, 0)
    assert (params.max_tokens, params.ignore_eos) == (1200, False)  # the worker's own parameters are untouched


class _Run:
    def __init__(self, steps: int, clock: _Clock) -> None:
        self.left, self.steps, self.clock = steps, 0, clock

    @property
    def done(self) -> bool:
        return self.left == 0

    def step(self) -> None:
        self.clock.sleep(0.002)
        self.left -= 1
        self.steps += 1


def test_interleaving_runs_one_other_step_per_engine_step_and_takes_its_time_out_of_the_baseline(monkeypatch):
    # the baseline loop makes 3 engine steps of 1 ms; the other path needs 5 steps of 2 ms: 3 run before the
    # baseline's steps, 2 after it ended. So the baseline's share is 3 x 1 = 3 ms, the other's 5 x 2 = 10 ms.
    clock = _Clock()
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=clock.read, thread_time=clock.read))
    calls = []

    class Engine:
        def step(self):
            calls.append("engine")
            clock.sleep(0.001)
            return []

    llm = SimpleNamespace(llm_engine=Engine())

    def baseline():
        for _ in range(3):
            llm.llm_engine.step()
        return "outputs"

    out = interleaved(llm, baseline, lambda: _Run(5, clock), lambda run: (calls.append("other"), run.step()))
    assert calls == ["other", "engine"] * 3 + ["other"] * 2
    assert out["result"] == "outputs" and out["other"].steps == 5
    assert abs(out["baseline_wall"] - 0.003) < 1e-12 and abs(out["other_wall"] - 0.010) < 1e-12
    assert abs(out["baseline_cpu"] - 0.003) < 1e-12 and abs(out["other_cpu"] - 0.010) < 1e-12
    assert "step" not in vars(llm.llm_engine)  # the hook is gone after the call: the class's method again


def test_ratio_is_the_median_of_the_per_round_ratios():
    # rounds: 90/100, 100/100, 50/100 -> ratios 0.9, 1.0, 0.5: median 0.9
    s = ratio_summary([90.0, 100.0, 50.0], [100.0, 100.0, 100.0])
    assert (s["ratio"], s["ratio_min"], s["ratio_max"]) == (0.9, 0.5, 1.0)
    assert (s["worker_tps"], s["baseline_tps"]) == (90.0, 100.0)
