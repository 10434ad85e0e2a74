"""The session endpoint of one rollout worker (gateway.enabled): its sessions, its call inbox and its HTTP server,
built from the run's config. The worker's loop calls `pump` before each engine step and hands the groups of
finished sessions (`take_groups`) to the controller as scored groups: their reward came from the client, so no
reward worker scores them again. With gateway.agent (or gateway.verifiers_env), the service also runs that agent
on the prompts the worker leases (gateway/agent_runner.py): their groups come back the same way, under the leased
ids."""

import json
from pathlib import Path
from typing import Any, Callable

from gateway.agent_runner import AgentRunner
from gateway.chat_render import ChatRenderer
from gateway.engine_bridge import CallInbox
from gateway.request_fields import Sampling
from gateway.server import GatewayServer, ServeSettings
from gateway.sessions import SessionBook
from gateway.verifiers_env import VerifiersAgent
from protocols.config import RunConfig
from protocols.trajectory import TrajectoryGroup


class GatewayService:
    def __init__(self, cfg: RunConfig, tokenizer: Any, worker_id: int, make_params: Callable[[int, Any], Any]) -> None:
        g = cfg.gateway
        folder = Path(cfg.output_dir) / "gateway"
        folder.mkdir(parents=True, exist_ok=True)
        self.book = SessionBook(ChatRenderer(tokenizer), g.history, g.max_sessions, g.session_timeout_s,
                                cfg.rollout.samples_per_prompt, worker_id,
                                records=folder / f"episodes-worker-{worker_id}.jsonl")
        self.inbox = CallInbox(make_params)
        settings = ServeSettings(
            model_name=g.model_name, max_tokens=g.max_tokens or cfg.rollout.max_response_tokens,
            max_model_len=cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens,
            max_calls_in_flight=g.max_calls_in_flight, retry_after_s=g.retry_after_s, tool_parser=g.tool_parser,
            max_request_bytes=g.max_request_bytes,
            sampling=Sampling(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p))
        self.server = GatewayServer(self.book, self.inbox, settings, g.host, g.port + worker_id if g.port else 0)
        self.server.start()
        agent = VerifiersAgent(g.verifiers_env) if g.verifiers_env else g.agent
        self.agents = AgentRunner(agent, self.server, self.book, cfg.rollout.samples_per_prompt,
                                  g.agent_timeout_s, g.max_calls_in_flight) if agent else None
        """gateway.agent or gateway.verifiers_env: the in-process agent that plays this worker's leased prompts; None
        without one."""
        self.worker_id = worker_id
        self._write_url(cfg.output_dir)

    def _write_url(self, output_dir: str) -> None:
        """`RUN/gateway/worker-<id>.json` names this worker's endpoint, for agent programs to find it (its
        sessions' records go to `episodes-worker-<id>.jsonl` beside it)."""
        folder = Path(output_dir) / "gateway"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"worker-{self.worker_id}.json").write_text(
            json.dumps({"worker_id": self.worker_id, "url": self.url, "sessions": f"{self.url}/sessions"}))

    @property
    def url(self) -> str:
        return self.server.url

    def pump(self, decoding, start_new: bool = True) -> None:
        self.inbox.pump(decoding, start_new)

    def take_groups(self) -> list[TrajectoryGroup]:
        return self.book.take_groups()

    def take_dropped(self) -> list[tuple[str, str]]:
        """(group id, reason) of the leased groups that did not go on."""
        return self.book.take_dropped()

    def report(self) -> dict[str, float]:
        return {**self.book.counts, "calls_in_flight": self.inbox.in_flight,
                "open_sessions": self.book.open_sessions, "groups_open": self.book.open_groups,
                **(self.agents.report() if self.agents is not None else {})}

    def stop(self) -> None:
        if self.agents is not None:
            self.agents.close()
        self.server.stop()
        self.inbox.fail_all("the rollout worker stopped serving")
