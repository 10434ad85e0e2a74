"""The agent demo's held-out figures through its own agent (docs/agents.md): demos/products_agent.py plays each of
the config's held-out problems once on a session endpoint served by a vLLM engine over a model folder, and the
accuracy is the share of episodes its reward marks correct. Greedy by default (the endpoint of a run samples at
rollout.temperature; this script sets the engine's calls to temperature 0 for the measurement);
`--temperature 1` measures what the run's sessions sample.

    .venv/bin/python benchmarks/agent_demo.py demo runs/demo_agent/final_model

`demo` is the cached warm-started model of deploy/configs/demo_agent.yaml. The engine is a rollout worker built
outside Ray, its decode loop stepped by gateway/engine_bridge.py's EngineThread (as tests/test_session_endpoint.py
does); no training happens.
"""

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "configs" / "demo_agent.yaml"


async def play_all(url: str, prompts: list, concurrency: int) -> list[dict]:
    import httpx

    from demos.products_agent import run
    from gateway.agent_runner import task_row

    slots = asyncio.Semaphore(concurrency)

    async def one(prompt) -> dict:
        # no kept-alive connections: under load an episode can outlast the server's keep-alive (5 s), and a request
        # on a connection the server just closed fails (httpx.ReadError)
        async with slots, httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) as client:
            # a group of one: nothing here trains (the endpoint counts the group's size as wrong for training)
            s = (await client.post(f"{url}/sessions", json={"group_size": 1})).json()
            try:
                return await run(task_row(prompt), s["base_url"], s["api_key"])
            finally:
                await client.post(f"{url}/sessions/{s['session_id']}/finish",
                                  headers={"Authorization": f"Bearer {s['api_key']}"})

    return await asyncio.gather(*(one(p) for p in prompts))


def score(folder: str, config: str, temperature: float, concurrency: int) -> dict:
    from transformers import AutoTokenizer

    from actors.rollout_worker import RolloutWorker
    from cluster.model_folder import fit_lengths_to_model, resolve_model_path
    from gateway.engine_bridge import EngineThread
    from protocols.config import load_config
    from rewards.datasets import load_arithmetic_prompts
    from rewards.environment import prompt_tools

    cfg = load_config(config, [f"output_dir={tempfile.mkdtemp(prefix='agent_demo_score_')}", "gateway.agent=''",
                               "weight_sync.verify_every=0"])
    path = resolve_model_path(cfg) if folder == "demo" else folder
    cfg = fit_lengths_to_model(cfg, path)
    prompts, _ = load_arithmetic_prompts(cfg.data, "test", AutoTokenizer.from_pretrained(path),
                                         tools=prompt_tools(cfg.tools))
    worker = RolloutWorker(cfg, 0, path)
    if temperature != cfg.rollout.temperature:
        from vllm import SamplingParams

        worker.gateway.inbox.make_params = lambda max_tokens, options: SamplingParams(
            n=1, temperature=temperature, max_tokens=max_tokens, logprobs=0)
    engine = EngineThread(worker.decoding, worker.gateway.inbox).start()
    start = time.perf_counter()
    try:
        results = asyncio.run(play_all(worker.gateway.url, prompts, concurrency))
    finally:
        engine.stop()
        worker.gateway.stop()
    return {"model": folder, "problems": len(prompts), "temperature": temperature,
            "accuracy": sum(r["correct"] for r in results) / len(results),
            "call_rate": sum(r["calls"] > 0 for r in results) / len(results),
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model folders, or `demo` for the cached warm-started model")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=64, help="episodes played at once")
    args = parser.parse_args()
    for folder in args.models:
        print(json.dumps(score(folder, args.config, args.temperature, args.concurrency)), flush=True)


if __name__ == "__main__":
    main()
