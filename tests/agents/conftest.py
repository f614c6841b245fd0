"""The real-agent lane's shared pieces: ONE ``proxrl serve`` on the tiny model and ONE warm-up
for every agent of the session.

The warm-up: each agent runs once against the untrained model (its answer is noise, its
prompt is stored), the tiny model (with a sliding attention window, so that the fine-tune sees
only the prompts' tails: ``warmup.py``) is fine-tuned on those prompts and published to the
running server through ``POST /admin/weights``. The warmed model is cached by what it depends on
(the lock, the agents' configuration, the warm-up code, the day: the agents put the date in
their prompts; the agents selected: ``PROXRL_AGENTS`` names some to work on one alone),
so a rerun skips the capture and the fine-tune.
"""

from __future__ import annotations

import datetime
import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from server.common import tiny_model
from tests.agents import agent_programs as lane
from tests.agents import warmup
from tests.support import ProxyProcess

MODEL = "tiny"
CONTEXT = 32768
WINDOW = 128  # each layer's attention window: the warm-up trains on the prompts' last 4 x 128
# The longest answer of the lane's run (RunConfig.max_completion_tokens): Codex asks no limit,
# Claude Code 32,000, so the untrained model's capture answers would run to the context's end;
# the warmed model's answers (a tool call, "Done.") are under 30 tokens.
ANSWER_LIMIT = 64


@dataclass
class Lane:
    """The running server, the installed agents, and a session per agent run."""

    proxy: ProxyProcess
    modules: Path
    root: Path
    run_id: str
    warm_up: dict = field(default_factory=dict)

    def rest(self, method: str, path: str, **kwargs) -> dict:
        reply = httpx.request(
            method, f"{self.proxy.url}{path}", headers=self.proxy.admin, timeout=120, **kwargs
        )
        assert reply.is_success, reply.text
        return reply.json()

    def workdir(self, agent: lane.Agent) -> Path:
        """The agent's working folder: the same for its capture run and its test, so both
        prompts name it alike."""
        path = self.root / "work" / agent.name
        path.mkdir(parents=True, exist_ok=True)
        (path / "notes.txt").write_text("hello\n")
        return path

    def run(self, agent: lane.Agent) -> tuple[dict, lane.AgentRun]:
        """A new session and one run of ``agent`` in it: (the session, the run)."""
        session = self.rest(
            "POST", "/rl/sessions", json={"run_id": self.run_id, "metadata": {"agent": agent.name}}
        )
        home = self.root / "home" / f"{agent.name}-{session['session_id']}"
        run = agent.run(
            self.modules,
            home,
            self.workdir(agent),
            session["base_url"],
            session["api_key"],
            MODEL,
        )
        return session, run

    def session(self, session_id: str) -> dict:
        return self.rest("GET", f"/rl/sessions/{session_id}")


def _warm_key() -> str:
    digest = hashlib.sha256()
    for path in (Path(lane.__file__), Path(warmup.__file__), Path(tiny_model.__file__)):
        digest.update(path.read_bytes())
    digest.update(lane.lock_hash().encode())
    digest.update(datetime.date.today().isoformat().encode())
    digest.update(",".join(agent.name for agent in lane.selected()).encode())
    return digest.hexdigest()[:16]


@pytest.fixture(scope="session")
def agent_lane(tmp_path_factory) -> Lane:
    from transformers import AutoTokenizer

    root = Path("/tmp/proxrl-agent-lane")  # stable: the agents' prompts name their folders
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    modules = lane.install()
    models = tmp_path_factory.mktemp("agents-model")
    base = tiny_model.create_tiny_model(models / MODEL, context=CONTEXT, window=WINDOW)
    warmed = lane.cache_root() / f"warm-{_warm_key()}"
    with ProxyProcess(base, tmp_path_factory.mktemp("agents-serve")) as proxy:
        config = {"max_completion_tokens": ANSWER_LIMIT}
        reply = httpx.post(
            f"{proxy.url}/rl/runs",
            headers=proxy.admin,
            json={"name": "agents", "config": config},
            timeout=60,
        )
        assert reply.status_code == 201, reply.text
        state = Lane(proxy, modules, root, reply.json()["id"])
        if not (warmed / "model.safetensors").exists():
            tokenizer = AutoTokenizer.from_pretrained(base)
            examples = []
            for agent in lane.selected():
                session, _ = state.run(agent)
                (turn, *_) = state.session(session["session_id"])["turns"]
                examples += warmup.examples_for(
                    tokenizer,
                    turn["prompt_ids"],
                    agent.shell_tool,
                    agent.arguments,
                    agent.result_format,
                )
            state.warm_up = warmup.warm_up(base, warmed, examples)
        state.rest("POST", "/admin/weights", json={"model_path": str(warmed)})
        yield state
        shutil.rmtree(root, ignore_errors=True)
