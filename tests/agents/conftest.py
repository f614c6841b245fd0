"""The real-agent lane's shared pieces: ONE ``proxrl serve`` on the tiny model for the session,
and a warmed model per agent.

The warm-up: each agent runs once against the untrained model (its answer is noise, its
prompt is stored); then, per agent, the tiny model (with a sliding attention window, so that the
fine-tune sees only the prompts' tails: ``warmup.py``) is fine-tuned on that agent's prompt.
An agent's test publishes its warmed model to the running server through
``POST /admin/weights`` before it runs the agent. One model per agent, not one for all: a joint
fine-tune on three agents' prompts, whose last tokens look alike but ask for different calls,
was still at probability 0 after 100 steps where each alone converges in 50-80, for the same
number of forward passes. Each warmed model is cached by what it depends on (the lock, the
agents' configuration, the warm-up code, the day: the agents put the date in their prompts), so
a rerun skips the capture and the fine-tune. ``PROXRL_AGENTS`` names the agents to prepare, to
work on one alone.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
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
DONE = "warm-up.json"  # written last into a warmed model's folder: how its warm-up went


@dataclass
class Lane:
    """The running server, the installed agents, and a session per agent run."""

    proxy: ProxyProcess
    modules: Path
    root: Path
    run_id: str
    warm_up: dict = field(default_factory=dict)  # per agent: how its warm-up went
    served: str | None = None  # the agent whose warmed model is served (None: the untrained)

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

    def run_warm(self, agent: lane.Agent) -> tuple[dict, lane.AgentRun]:
        """``run`` on ``agent``'s warmed model, published first unless it is the one served."""
        if self.served != agent.name:
            model = warm_dir(agent)
            self.rest("POST", "/admin/weights", json={"model_path": str(model)})
            self.served = agent.name
            self.warm_up.setdefault(agent.name, json.loads((model / DONE).read_text()))
        return self.run(agent)

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


def warm_dir(agent: lane.Agent) -> Path:
    """Where ``agent``'s warmed model is cached, by what it depends on."""
    digest = hashlib.sha256()
    for path in (Path(lane.__file__), Path(warmup.__file__), Path(tiny_model.__file__)):
        digest.update(path.read_bytes())
    digest.update(lane.lock_hash().encode())
    digest.update(datetime.date.today().isoformat().encode())
    digest.update(agent.name.encode())
    return lane.cache_root() / f"warm-{agent.name}-{digest.hexdigest()[:16]}"


@pytest.fixture(scope="session")
def agent_lane(tmp_path_factory) -> Lane:
    from transformers import AutoTokenizer

    root = Path("/tmp/proxrl-agent-lane")  # stable: the agents' prompts name their folders
    # One lane at a time on this machine: a second (another worker, another checkout's run)
    # would empty the first one's folder under it.
    claim = open(f"{root}.lock", "w")  # noqa: SIM115 (held until the session ends)
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pytest.fail(
            f"another process runs the agent lane in {root}: the lane's tests share one worker "
            "(tests/conftest.py's xdist_group), and two checkouts run it one after the other"
        )
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    modules = lane.install()
    models = tmp_path_factory.mktemp("agents-model")
    base = tiny_model.create_tiny_model(models / MODEL, context=CONTEXT, window=WINDOW)
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
        # Every capture runs on the untrained model, before any warm model is published.
        cold = [agent for agent in lane.selected() if not (warm_dir(agent) / DONE).exists()]
        first_prompts = {}
        for agent in cold:
            session, _ = state.run(agent)
            (turn, *_) = state.session(session["session_id"])["turns"]
            first_prompts[agent.name] = turn["prompt_ids"]
        if cold:
            tokenizer = AutoTokenizer.from_pretrained(base)
        for agent in cold:
            examples = warmup.examples_for(
                tokenizer,
                first_prompts[agent.name],
                agent.shell_tool,
                agent.arguments,
                agent.result_format,
            )
            state.warm_up[agent.name] = warmup.warm_up(base, warm_dir(agent), examples)
            (warm_dir(agent) / DONE).write_text(json.dumps(state.warm_up[agent.name]))
        yield state
        shutil.rmtree(root, ignore_errors=True)
    claim.close()
