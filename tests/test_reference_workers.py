"""Reference workers: the frozen reference policy scored outside the learner, streamed with the trajectories."""

import pytest
import torch

from cluster.placement import PlacementError, check_plan, parse_node_spec, plan_placement
from learner.prepare import check_streamed_scores, reward_kl
from protocols.config import ConfigError, load_config
from protocols.metrics import unknown_names
from protocols.training_batch import TrainingBatch
from protocols.trajectory import Prompt, Trajectory, TrajectoryGroup


def _trajectory(group_id: str, index: int, response: list[int], behavior: list[float]) -> Trajectory:
    return Trajectory(group_id=group_id, sample_index=index, prompt=Prompt(prompt_id="p", prompt_token_ids=[1, 2]),
                      response_token_ids=response, behavior_logprobs=behavior, token_versions=[0] * len(response),
                      finish_reason="stop")


# --- config, placement and the records (no Ray) ------------------------------------------------------------------
def test_reference_workers_with_a_preset_without_kl_are_refused():
    # dapo has beta 0: the log-probs would be computed and never read, so the config is refused by name
    with pytest.raises(ConfigError, match=r"reference.num_workers=1 but algorithm.kl.beta=0 \(preset 'dapo'"):
        load_config(None, ["reference.num_workers=1", "algorithm.preset=dapo"])
    with pytest.raises(ConfigError, match="reference.resources names the built-in resource 'GPU'"):
        load_config(None, ["reference.num_workers=1", "algorithm.preset=grpo", "reference.resources={GPU: 1}"])
    assert load_config(None, ["reference.num_workers=1", "algorithm.preset=grpo"]).reference.num_workers == 1
    assert load_config(None, []).reference.num_workers == 0  # the default keeps the in-learner reference


def test_reference_role_reserves_its_own_bundles():
    cfg = load_config(None, ["algorithm.preset=grpo", "reference.num_workers=2", "reference.cpus=2",
                             "reference.gpus=0.5", "reference.resources={ref_node: 1}", "cluster.use_gpus=true"])
    plan = plan_placement(cfg)
    assert plan.role("reference").bundles == [{"CPU": 2.0, "GPU": 0.5, "ref_node": 1.0}] * 2
    # 1 rollout engine + 1 learner rank + 2 x 0.5 reference = 3 GPUs: a 2-GPU node is refused with every term
    with pytest.raises(PlacementError, match=r"reference.num_workers=2 x reference.gpus=0.5 = 3 GPUs"):
        check_plan(plan, parse_node_spec("GPU=2,CPU=16,ref_node=2"))
    check_plan(plan, parse_node_spec("GPU=3,CPU=16,ref_node=2"))
    # no workers: no role at all (nothing reserved, the plan printout unchanged)
    assert [r.role for r in plan_placement(load_config(None, [])).roles] == ["rollout", "learner", "reward"]


def test_group_takes_ref_logprobs_of_matching_shape_only():
    group = TrajectoryGroup(group_id="g0", trajectories=[_trajectory("g0", 0, [5, 6], [-0.1, -0.2]),
                                                         _trajectory("g0", 1, [7], [-0.3])])
    joined = group.with_ref_logprobs([[-1.0, -2.0], [-3.0]])
    assert [t.ref_logprobs for t in joined.trajectories] == [[-1.0, -2.0], [-3.0]]
    assert all(t.ref_logprobs is None for t in group.trajectories)  # a copy: the input is left as it was
    with pytest.raises(ValueError, match=r"group g0: reference log-probs of shape \[2, 2\]"):
        group.with_ref_logprobs([[-1.0, -2.0], [-3.0, -4.0]])
    streamed = load_config(None, ["algorithm.preset=grpo", "reference.num_workers=1"])
    check_streamed_scores(TrainingBatch.from_trajectories(joined.trajectories), streamed, ["g0", "g0"])
    # the batch of the joined group carries them, padded: row 1 has one token
    torch.testing.assert_close(TrainingBatch.from_trajectories(joined.trajectories).ref_logprobs,
                               torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]))
    with pytest.raises(RuntimeError, match=r"reference.num_workers=1 but the batch reached the learner without "
                                           r"ref_logprobs \(groups \['g0'\]"):
        check_streamed_scores(TrainingBatch.from_trajectories(group.trajectories), streamed, ["g0", "g0"])


def test_reward_kl_is_k1_on_behavior_logprobs_in_decoupled_mode():
    # rloo: KL in the reward, k1, and the default off_policy mode decoupled. The estimate is taken on the behavior
    # log-probs mu (the tokens were sampled from mu): k1 = mu - ref per token, 0 off the mask.
    # row 0: [-0.5 - (-1.0), -1.0 - (-1.0)] = [0.5, 0.0]; row 1: [-2.0 - (-1.5), pad] = [-0.5, 0.0]
    cfg = load_config(None, ["algorithm.preset=rloo"])
    assert cfg.algorithm.off_policy.mode == "decoupled" and cfg.algorithm.kl.estimator == "k1"
    batch = TrainingBatch.from_samples([[1], [1]], [[5, 6], [7]], [[-0.5, -1.0], [-2.0]],
                                       ref_logprobs=[[-1.0, -1.0], [-1.5]])
    kl = reward_kl(batch, cfg)
    torch.testing.assert_close(kl, torch.tensor([[0.5, 0.0], [-0.5, 0.0]]))
    # k3 on the same numbers: r = e^(ref - mu); row 0 token 0: e^-0.5 - 1 + 0.5 = 0.1065307
    k3 = reward_kl(batch, load_config(None, ["algorithm.preset=rloo", "algorithm.kl.estimator=k3"]))
    assert float(k3[0, 0]) == pytest.approx(0.1065307, rel=1e-6) and float(k3[0, 1]) == 0.0


def test_reference_forward_budget_needs_reference_workers():
    with pytest.raises(ConfigError, match=r"reference.max_tokens_per_micro_batch=4096 sets the reference workers' "
                                          r"forward size, but reference.num_workers=0"):
        load_config(None, ["algorithm.preset=grpo", "reference.max_tokens_per_micro_batch=4096"])


# --- the real actors ------------------------------------------------------------------------------------------------
def _samples(num: int, seed: int = 0) -> TrainingBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(num):
        length = 1 + i % 5  # ragged, so padding and micro-batch composition differ between the two paths
        prompts.append([1, 3 + i % 10, 13, 3 + (i * 7) % 10, 14][: 3 + i % 3])
        responses.append(torch.randint(3, 13, (length,), generator=g).tolist())
    return TrainingBatch.from_samples(prompts, responses, [[-2.5] * len(r) for r in responses],
                                      advantages=[[1.0] * len(r) for r in responses])


@pytest.mark.slow
def test_reference_worker_matches_the_learners_reference_path(ray_cluster, tiny_models):
    import ray

    from actors.reference_worker import ReferenceWorker
    from cluster.learner_group import LearnerGroup

    cfg = load_config(None, ["algorithm.preset=grpo", "model.dtype=float32", "learner.prompts_per_step=2",
                             "rollout.samples_per_prompt=4", "learner.micro_batch_size=8"])
    samples = _samples(8)
    # the worker starts in its actor while the learner group starts here
    worker = ray.remote(ReferenceWorker).options(num_cpus=1).remote(cfg, 0, tiny_models["tied"])
    learner = None
    try:
        learner = LearnerGroup(cfg, tiny_models["tied"])
        # the in-learner reference: one micro-batch of all 8
        expected = samples.per_sample_rows(learner.ref_logprobs(samples))
        # the stream scores groups of 4 separately (other padding widths): the numbers must not depend on it
        got = []
        for start in (0, 4):
            group = TrajectoryGroup(group_id=f"g{start}", trajectories=[
                _trajectory(f"g{start}", i, samples.response(start + i), [-2.5] * len(samples.response(start + i)))
                .model_copy(update={"prompt": Prompt(prompt_id="p", prompt_token_ids=samples.prompt_ids[start + i])})
                for i in range(4)])
            got.extend(ray.get(worker.score_group.remote(group)))
        stats = ray.get(worker.stats.remote())
    finally:
        ray.kill(worker)
        if learner is not None:
            learner.shutdown()
    assert [len(r) for r in got] == samples.response_lengths.tolist()
    gap = max(abs(a - b) for row_a, row_b in zip(got, expected) for a, b in zip(row_a, row_b))
    assert gap <= 1e-5, gap
    assert all(v < 0 for row in got for v in row)  # log-probs of a 15-symbol vocabulary, none certain
    assert stats["groups"] == 2 and stats["samples"] == 8
    assert stats["tokens"] == sum(samples.sample_tokens())


def test_reference_forward_budget_changes_the_forwards_not_the_numbers(tiny_models):
    from actors.reference_worker import ReferenceWorker

    # 12 ragged samples of at most 5 prompt + 5 response tokens. Sample-count plan: micro_batch_size 2 -> 6
    # forwards. Reference budget 128 tokens: padded rows cost 12 x the longest <= 12 x 10 = 120: one forward.
    settings = ["algorithm.preset=grpo", "model.dtype=float32", "learner.micro_batch_size=2",
                "reference.num_workers=1"]
    samples = _samples(12, seed=3)
    assert max(samples.sample_tokens()) <= 10
    learners = ReferenceWorker(load_config(None, settings), 0, tiny_models["tied"])
    own = ReferenceWorker(load_config(None, [*settings, "reference.max_tokens_per_micro_batch=128"]), 0,
                          tiny_models["tied"])
    expected, got = learners.score_batch(samples), own.score_batch(samples)
    assert learners.stats()["micro_batches"] == 6 and own.stats()["micro_batches"] == 1
    assert [len(r) for r in got] == samples.response_lengths.tolist()
    # padding never reaches a real position, so the numbers match whatever the batch (fp32)
    gap = max(abs(a - b) for row_a, row_b in zip(got, expected) for a, b in zip(row_a, row_b))
    assert gap <= 1e-5, gap


@pytest.mark.slow
def test_grpo_run_trains_on_streamed_ref_logprobs_without_a_learner_copy(ray_cluster, tmp_path):
    """Also resizes the reward pool 1 -> 2 -> 1 between steps from Python (cluster/worker_pool.py) and the rollout
    pool the same way through `relayrl scale` (cluster/scale_requests.py), on this run rather than a Trainer of
    its own."""
    import json
    import time

    import ray

    from cli.main import main as cli_main
    from cluster.supervisor import WorkerLost
    from cluster.trainer import Trainer

    # fault.max_replacements=0 (no death in the run itself): a reference worker killed afterwards is one death too
    # many, so the error path is checked here; replacement itself: tests/test_worker_failure.py
    cfg = load_config(None, [f"output_dir={tmp_path}", "logging.plots=false",
                             "algorithm.preset=grpo", "reference.num_workers=1",
                             "train.steps=5", "train.max_staleness=0", "learner.prompts_per_step=2",
                             "rollout.samples_per_prompt=4", "data.num_eval_prompts=8", "fault.max_replacements=0"])
    trainer = Trainer(cfg)
    trained: list[TrajectoryGroup] = []
    step = trainer.step
    resized: dict = {}
    record_at: dict = {}  # version -> "grow" / "shrink": record the request's result when the next step starts

    def step_then_resize(groups):  # records what the learner trains on; resizes the pools between steps
        if trainer.version in record_at:  # the run loop applied the scale request after the step before
            done = json.loads((tmp_path / "control" / "scale_done.json").read_text())
            resized[record_at.pop(trainer.version)].update({
                "seconds": done["seconds"], "done": done, "ids": list(trainer.supervisor.rollout_ids),
                "controller": ray.get(trainer.controller.__ray_call__.remote(
                    lambda c: (list(c.stage.workers["reward"]), c.num_workers, sorted(c.lost_workers),
                               sorted(c.get_worker_stats()), sorted(c.first_scored_at)))),
                "reward_workers": list(trainer.reward_workers)})
        joining = trainer.pools["rollout"].joining
        if joining is not None:
            # the grow asked for after step 1 started its engine and training went on (step 2 here); once it
            # serves, the run loop adds it after this step
            assert trainer.version == 1 and len(trainer.rollout_workers) == 1
            ray.wait(joining.probes, num_returns=len(joining.probes), timeout=300)
            record_at[2] = "grow"
        trained.extend(groups)
        metrics = step(groups)
        if trainer.version in (1, 3):
            t0 = time.monotonic()
            size = {1: 2, 3: 1}[trainer.version]  # 1 -> 2 after step 1, back to 1 after step 3
            trainer.pools["reward"].resize(size)
            resized["grow" if size == 2 else "shrink"] = {"reward_s": time.monotonic() - t0}
            assert cli_main(["scale", str(tmp_path), "--rollout-workers", str(size), "--wait", "0"]) == 0
            if size == 1:
                record_at[4] = "shrink"  # the worker leaves after step 3 and drains while step 4 trains
        if trainer.version == 4:  # its groups came back: the drain ends after step 4
            deadline = time.monotonic() + 120
            while ray.get(trainer.controller.leases_of.remote(1)) and time.monotonic() < deadline:
                time.sleep(0.05)
        if trainer.version == 5:  # more than the local cluster can ever hold: refused by the driver, the run unharmed
            assert cli_main(["scale", str(tmp_path), "--rollout-workers", "1000", "--wait", "0"]) == 0
        return metrics

    trainer.step = step_then_resize
    try:
        summary = trainer.run()
        holds_ref = ray.get([rank.__ray_call__.remote(lambda r: r.ref_model is not None)
                             for rank in trainer.learner.ranks])
        stats = ray.get(trainer.reference_workers[0].stats.remote())
        # A reference worker that dies past the limit stops the run with an error naming it, never a hang.
        ray.get(trainer.controller.resume.remote())
        ray.kill(trainer.reference_workers[0])
        trainer.supervisor.start_runs()
        with pytest.raises(WorkerLost, match=r"reference worker 0 died .*fault.max_replacements=0 allows no more"):
            # groups the reference scored before its death may still fill a batch or two; the next wait meets it
            for _ in range(20):
                trainer._wait_for_batch()
        ray.get(trainer.controller.stop.remote())
        ray.get(trainer.supervisor.run_refs, timeout=60)
    finally:
        trainer.shutdown()
    assert summary["steps"] == 5 and len(trained) == 5 * 2
    # resize: the controller holds the live reward list, the rollout pool's size and the retired ids; the added
    # rollout worker (id 1: slot 1, never used before) took part, then drained out and its id stays retired
    grown, shrunk = resized["grow"], resized["shrink"]
    print("reward, rollout pool resize seconds: 1 -> 2 {:.1f}, {:.1f}; 2 -> 1 {:.1f}, {:.1f}".format(
        grown["reward_s"], grown["seconds"], shrunk["reward_s"], shrunk["seconds"]))
    assert (grown["done"]["id"], grown["done"]["rollout"], shrunk["done"]["id"], shrunk["done"]["rollout"]) == (1, 2, 2, 1)
    assert grown["done"]["steps_while_resizing"] == 1  # step 2 trained while the new engine started
    # the leaving worker drained beside step 4 (1), or held no group when it left (0: the drain ended at once)
    assert shrunk["done"]["steps_while_resizing"] in (0, 1)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # logged after each step's resize work: the engine joins after step 2; the worker leaves the pool after step 3
    assert [line["rollout/num_workers"] for line in logged] == [1.0, 2.0, 1.0, 1.0, 1.0]
    assert grown["ids"] == [0, 1] and shrunk["ids"] == [0]
    refused = json.loads((tmp_path / "control" / "scale_done.json").read_text())
    assert (refused["id"], refused["rollout"]) == (3, 1) and refused["error"].startswith(
        "1000 rollout workers are more than this cluster can ever hold beside the rest of the run: "
        "rollout.num_workers=1000 x cluster.rollout_cpus=1 + "), refused
    assert not (tmp_path / "control" / "driver.json").exists()  # the loop ended: `relayrl scale` says so
    assert grown["controller"][:3] == (grown["reward_workers"], 2, []) and len(grown["reward_workers"]) == 2
    assert shrunk["controller"][:3] == (shrunk["reward_workers"], 1, [1])
    assert shrunk["reward_workers"] == grown["reward_workers"][:1]  # the launch worker stays
    # the added worker is sent its first load and its run unwaited: on a loaded machine the shrink may find it
    # still loading, and it leaves having served nothing; once it handed over a group, its report reached the
    # controller
    stats_ids, scored_ids = shrunk["controller"][3], shrunk["controller"][4]
    assert 1 not in scored_ids or 1 in stats_ids, shrunk["controller"]
    # nothing lost, nothing trained twice: every admitted group trained, dropped with a reason, or queued
    q = summary["queue"]
    dropped = sum(v for k, v in q.items() if k.startswith("queue/dropped_"))
    assert q["queue/admitted"] == q["queue/trained"] + dropped + q["queue/depth"], q
    assert len(summary["trained_group_ids"]) == len(set(summary["trained_group_ids"])) == q["queue/trained"] == 10
    assert summary["replaced_workers"] == {"rollout": 0, "reward": 0, "reference": 0, "teacher": 0,
                                           "critic": 0}
    assert holds_ref == [False]  # the learner rank never loaded a reference copy
    for t in [t for g in trained for t in g.trajectories]:
        assert t.ref_logprobs is not None and len(t.ref_logprobs) == len(t.response_token_ids)
        # On-policy at version 0 the sampler is the reference itself: vLLM's behavior log-probs and the reference
        # worker's transformers forward agree (about 1e-6 in fp32 on this stack).
        if t.max_version == 0:
            assert max(abs(a - b) for a, b in zip(t.ref_logprobs, t.behavior_logprobs)) < 1e-3
    assert stats["groups"] >= len(trained)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # the workers' own counters reach the log per step and the summary over the run, none lost or counted twice
    totals = summary["reference_workers"]
    assert totals["reference_worker/groups"] == stats["groups"] and totals["reference_worker/samples"] == stats["samples"]
    assert sum(r["reference_worker/groups"] for r in rows) <= stats["groups"]
    assert totals["reference_worker/tokens_per_s"] > 0 and unknown_names(rows[-1]) == []
    # step 1 trains version 0 = the reference: the KL in the loss (k3 from the streamed values against the
    # learner's own forward) is 0 up to float noise; after updates it stays a finite, non-negative k3 mean
    assert abs(rows[0]["kl"]) < 1e-5 and all(0 <= r["kl"] < 1 for r in rows)
