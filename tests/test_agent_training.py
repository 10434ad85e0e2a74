"""A run fed by an in-process agent (gateway.agent) on its own data set: the rollout worker plays each prompt it
leases with the agent, written with the stock `openai` SDK, `samples_per_prompt` times in sessions of its own
endpoint; the groups trained are those sessions' episodes under the leased ids, each sample exactly the tokens the
engine saw and sampled (the endpoint's record of each call), with loss on the sampled tokens only."""

import itertools
import json

import pytest
from openai import AsyncOpenAI

from cluster.trainer import Trainer
from demos.agent_task import CALCULATOR_SCHEMA
from gateway.sessions import SESSION_GROUP_PREFIX
from protocols.config import load_config
from protocols.data import DataConfig
from rewards.datasets import encode_prompt
from tests.conftest import record_batches

pytestmark = pytest.mark.slow


RUNS = itertools.count()


async def agent(task, base_url, api_key):
    """Two calls: the task, then a calculator result after the reply. The reward alternates 0, 1 in the order the
    runs start (a group's runs start one after the other), so a group's rewards differ and no group is dropped for
    zero variance: the random model's replies say nothing."""
    reward = float(next(RUNS) % 2)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    try:
        messages = [{"role": "user", "content": task["prompt"]}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA])
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "call_0", "content": task["answer"]}]
        second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR_SCHEMA])
    finally:
        await client.close()
    assert first.choices[0].message.role == second.choices[0].message.role == "assistant"
    return {"reward": reward, "correct": False}


def test_a_run_trains_the_groups_its_in_process_agent_plays(ray_cluster, tmp_path):
    from demos.arithmetic_model import build_random_model
    from protocols.tools import ToolsConfig

    model = build_random_model(tmp_path / "model", tied=False, seed=1,
                               tools=ToolsConfig(builtin=["calculator"], call_format="hermes"))
    cfg = load_config(None, [
        f"output_dir={tmp_path / 'run'}", f"model.path={model}", "model.dtype=float32", "cluster.use_gpus=false",
        "data.format=arithmetic", "data.arithmetic_op=\"*\"", "data.arithmetic_min_operand=100",
        "data.arithmetic_max_operand=9999", "data.arithmetic_num_train=64", "data.num_eval_prompts=4",
        "data.max_prompt_tokens=24", "tools.builtin=[calculator]", "tools.call_format=hermes", "tools.max_turns=2",
        "gateway.enabled=true", "gateway.agent=tests.test_agent_training:agent", "gateway.max_tokens=6",
        "rollout.num_workers=1", "rollout.max_response_tokens=24", "rollout.gpu_memory_utilization=0.1",
        "rollout.max_num_seqs=16", "rollout.prompts_in_flight=4", "rollout.enforce_eager=true",
        "rollout.samples_per_prompt=2", "reward.num_workers=1", "reward.num_processes=1", "learner.num_ranks=1",
        "learner.zero_stage=2", "learner.prompts_per_step=2", "learner.micro_batch_size=4",
        "learner.gradient_checkpointing=false", "algorithm.preset=grpo", "train.steps=2", "train.max_staleness=4",
        "train.eval_every=0", "train.save_every=0", "weight_sync.verify_every=0"])
    trainer = Trainer(cfg)
    batches = record_batches(trainer)
    try:
        summary = trainer.run()
    finally:
        trainer.shutdown()
    trained = [g for _, groups in batches for g in groups]
    assert summary["steps"] == 2 and len(trained) == 4  # 2 steps x 2 prompts
    records = {}
    for line in (tmp_path / "run" / "gateway" / "episodes-worker-0.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["session_id"]] = record
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for group in trained:
        # the leased group itself (not an endpoint-made group), of the learner's size
        assert not group.group_id.startswith(SESSION_GROUP_PREFIX) and len(group.trajectories) == 2
        for t in group.trajectories:
            record = records[t.prompt.metadata["episode"].removeprefix("session/")]
            assert record["group_id"] == group.group_id and record["trained"]
            first, second = record["calls"]
            # the first prompt is the data loader's for the task (the same template, with the tools)
            task = first["messages"][0]["content"]
            assert first["prompt_ids"] == encode_prompt(task, DataConfig(format="arithmetic"), tokenizer,
                                                        [CALCULATOR_SCHEMA])
            # one sample: the first call's prompt; its sampled ids, the inserted ids, the second call's sampled ids
            inserted = second["prompt_ids"][len(first["prompt_ids"]) + len(first["sampled_ids"]):]
            assert second["prompt_ids"] == [*first["prompt_ids"], *first["sampled_ids"], *inserted]
            assert t.prompt.prompt_token_ids == first["prompt_ids"]
            assert t.response_token_ids == [*first["sampled_ids"], *inserted, *second["sampled_ids"]]
            assert t.loss_mask == [True] * len(first["sampled_ids"]) + [False] * len(inserted) + \
                [True] * len(second["sampled_ids"])
            assert t.behavior_logprobs == [*first["behavior_logprobs"], *[0.0] * len(inserted),
                                           *second["behavior_logprobs"]]
            assert t.reward == record["reward"]
    report = summary["rollout"][0]["gateway"]
    assert report["agent_rewards"] >= 8 and report["agent_errors"] == 0 and report["agent_groups"] >= 4
