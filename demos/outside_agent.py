"""An agent program outside the run, for a run fed by outside agents alone (gateway.outside_only; docs/agents.md
"A run fed by outside agents alone"). It reads the run folder's `gateway/endpoints.json`, waits until the run
serves, and plays the products task (`a*b=`, the agent demo's) in groups: for each task it opens `group_size`
sessions on one endpoint under one `group` key, plays each with demos/products_agent.py (the stock `openai` SDK,
the calculator as an OpenAI function schema) and posts the arithmetic verifier's check as the session's reward.
It stops once the run has finished, or after --tasks tasks.

    python demos/outside_agent.py runs/demo_outside            # beside `relayrl train --config demo_outside.yaml`
"""

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from demos.products_agent import run as play  # noqa: E402
from rewards.arithmetic_data import arithmetic_problems, problem_answer, problem_text  # noqa: E402


def read_endpoints(run_dir: Path) -> dict | None:
    """The run's endpoints file, or None before the run wrote it."""
    try:
        return json.loads((run_dir / "gateway" / "endpoints.json").read_text())
    except (FileNotFoundError, ValueError):  # not written yet (it is replaced whole, never half-written)
        return None


async def wait_ready(run_dir: Path, since: float, poll_s: float = 0.5) -> dict | None:
    """The endpoints once the run serves them; None once it has finished. A `finished` file written before `since`
    (time.time()) is an earlier run's in the same folder: this program may start before the run rewrites it."""
    path = run_dir / "gateway" / "endpoints.json"
    while True:
        endpoints = read_endpoints(run_dir)
        if endpoints is not None and endpoints["finished"] and path.stat().st_mtime >= since:
            return None
        if endpoints is not None and endpoints["ready"] and endpoints["workers"]:
            return endpoints
        await asyncio.sleep(poll_s)


def tasks(op: str, min_operand: int, max_operand: int, seed: int):
    """Endless products problems of the training split (the held-out split is never drawn), as agent tasks."""
    pairs = arithmetic_problems(max_operand, "train", 5000, seed, min_operand=min_operand)
    for i, (a, b) in enumerate(itertools.cycle(pairs)):
        yield {"prompt": problem_text(a, b, op), "answer": problem_answer(a, b, op), "prompt_id": f"outside/{i}"}


async def open_session(http: httpx.AsyncClient, url: str, group: str) -> dict:
    """POST /sessions, waiting out a 429 (the endpoint's back-pressure: too many sessions open)."""
    while True:
        response = await http.post(f"{url}/sessions", json={"group": group})
        if response.status_code != 429:
            response.raise_for_status()
            return response.json()
        await asyncio.sleep(float(response.headers.get("Retry-After", "1")))


async def play_session(http: httpx.AsyncClient, session: dict, task: dict, counts: Counter) -> float | None:
    """One episode in one session: its reward posted, or, if the episode failed, the session finished without one
    (it is then not trained, and the endpoint counts it)."""
    root = session["base_url"].rsplit("/v1", 1)[0]
    auth = {"Authorization": f"Bearer {session['api_key']}"}
    try:
        result = await play(task, session["base_url"], session["api_key"])
    except (openai.OpenAIError, httpx.HTTPError) as err:
        counts["episodes_failed"] += 1
        if counts["episodes_failed"] <= 3:
            print(f"episode failed ({type(err).__name__}: {err}); its session is finished without a reward",
                  flush=True)
        await http.post(f"{root}/finish", headers=auth)
        return None
    # the dict's other keys (correct, calls) are kept as the sample's info; `correct` feeds the accuracy metrics
    response = await http.post(f"{root}/reward", json={"reward": result}, headers=auth)
    counts["rewards_posted" if response.status_code == 200 else f"reward_status_{response.status_code}"] += 1
    return result["reward"]


async def play_group(http: httpx.AsyncClient, url: str, group_size: int, task: dict, counts: Counter) -> None:
    """One task played `group_size` times, in sessions of one endpoint under one group key (a group's sessions
    must all be on the same endpoint: each rollout worker forms its own groups)."""
    group = f"{task['prompt_id']}/{time.time_ns()}"
    sessions = [await open_session(http, url, group) for _ in range(group_size)]
    rewards = await asyncio.gather(*(play_session(http, s, task, counts) for s in sessions))
    counts["groups"] += 1
    counts["correct"] += sum(r == 1.0 for r in rewards)


async def main(args: argparse.Namespace) -> Counter:
    run_dir = Path(args.run_dir)
    counts: Counter = Counter()
    source = tasks(args.op, args.min_operand, args.max_operand, args.seed)
    played = 0
    since = time.time() - args.since_s
    # no kept-alive connections: under load a group can outlast the server's keep-alive (5 s), and a request on a
    # connection the server just closed fails
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        running: set[asyncio.Task] = set()
        while not args.tasks or played < args.tasks:
            endpoints = await wait_ready(run_dir, since)
            if endpoints is None:
                break
            # as many groups as the endpoints serve calls at once (more would only be answered 429 and retried)
            concurrency = args.concurrency or max(1, endpoints["max_calls_in_flight"] * len(endpoints["workers"])
                                                  // endpoints["group_size"])
            if len(running) >= concurrency:
                done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                _count_failures(done, counts)
                continue
            worker = endpoints["workers"][played % len(endpoints["workers"])]
            running.add(asyncio.create_task(play_group(http, worker["url"], endpoints["group_size"], next(source),
                                                       counts)))
            played += 1
        if running:  # at the run's end their calls fail or wait; they are counted, never retried
            done, left = await asyncio.wait(running, timeout=args.drain_s)
            _count_failures(done, counts)
            for task in left:
                task.cancel()
            counts["groups_cut_at_end"] += len(left)
    return counts


def _count_failures(done: set[asyncio.Task], counts: Counter) -> None:
    """A group that could not open its sessions (the run stopped, an error status) is counted and said."""
    for task in done:
        err = task.exception()
        if err is not None:
            counts["groups_failed"] += 1
            if counts["groups_failed"] <= 3:  # (at the run's end, every group still opening fails alike)
                print(f"a group failed: {type(err).__name__}: {err}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run's output_dir (it holds gateway/endpoints.json)")
    parser.add_argument("--tasks", type=int, default=0, help="tasks to play (each a group); 0: until the run ends")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="groups played at once; 0: gateway.max_calls_in_flight x endpoints / group size")
    parser.add_argument("--seed", type=int, default=0, help="the order of the problems")
    parser.add_argument("--op", default="*", choices=["+", "*"])
    parser.add_argument("--min-operand", type=int, default=100)
    parser.add_argument("--max-operand", type=int, default=9999)
    parser.add_argument("--since-s", type=float, default=0.0,
                        help="a finished run's endpoints file written more than this many seconds before this program "
                             "started is an earlier run's, and is waited past (0: any written before the start)")
    parser.add_argument("--drain-s", type=float, default=30.0, help="how long to wait for groups still in play")
    return parser.parse_args(argv)


if __name__ == "__main__":
    done = asyncio.run(main(parse_args()))
    print(json.dumps(dict(done)), flush=True)
