"""Two LoRA runs on one `proxrl serve`, each trained live by its own `proxrl train` (issue 29,
parts 2 and 5).

One proxy on the tiny model; runs A and B, each with an agent thread (the real openai SDK on
the run's sessions, a reward by a rule of the answer) and a `proxrl train` with a ``lora``
section. While both trainers run, both agents sample and reward. Then, from the outside:

- each trainer claimed only its own run's sessions, each at most once over both trainers, and
  each claimed session is ``consumed``; the run's sessions no trainer claimed still wait
  (none lost, none taken by the other run);
- each run's ``policy_version`` reached its trainer's last step, the engine holds
  ``<run>@<version>`` names of the versions each trainer published, and the base model
  served to the default run is unchanged (its input logprobs on a fixed prompt, asked of the
  engine before and after, agree within 1e-5): no full-weight swap happened;
- every recorded token of a run carries a version that run published (0 is the base), and its
  logprob equals a float64 teacher-forced forward of the base with that version's adapter
  merged (the directories the run's trainer published under ``weights/v*``, all kept here by
  ``publish.keep_versions``) within 1e-4; the trained adapters are far enough from the base
  and from each other that the check tells them apart.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support import ProxyProcess, teacher_forced_logprobs
from tests.trainer_runs import Server, finish, metrics, start_trainer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 3
TRAINER = (
    "batch_size=4",
    "max_staleness=1",
    f"max_steps={STEPS}",
    "lr=1e-2",  # large, so that three steps move each adapter well away from the base
    "lora.rank=4",
    "lora.alpha=8",
    f"publish.keep_versions={STEPS}",  # every version's adapter stays on disk for the check
)
# each run's admission bound from the start (the trainer sets the same): the agents wait for the
# trainer rather than sample every session from version 0 while it starts
BOUND = {"batch_size": 4, "max_staleness": 1}
LOGPROB_TOLERANCE = 1e-4  # float32 engine against the float64 reference
BASE_TOLERANCE = 1e-5  # the base before and after: the same engine, the same weights
FIXED_PROMPT = "Count from one to five, slowly."


class Agent(threading.Thread):
    """Episodes of one or two turns in one run, rewarded by a rule of the answer, until
    stopped."""

    def __init__(self, server: Server, run_id: str) -> None:
        super().__init__(daemon=True, name=f"agent-{run_id}")
        self.server, self.run_id = server, run_id
        self.stop = threading.Event()
        self.sessions: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                self.episode(i)
            except Exception as exc:
                self.errors.append(repr(exc))
                return
            i += 1

    def open(self) -> dict | None:
        """A session of the run; at its admission bound the server answers 429: ask again."""
        while not self.stop.is_set():
            reply = self.server.http.post(
                "/rl/sessions", json={"run_id": self.run_id, "task_id": "count"}
            )
            if reply.status_code != 429:
                assert reply.status_code == 201, reply.text
                return reply.json()
            time.sleep(0.2)
        return None

    def episode(self, i: int) -> None:
        created = self.open()
        if created is None:
            return
        self.sessions.append(created["session_id"])
        client = OpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=5)
        messages = [{"role": "user", "content": f"Count to {i % 7}."}]
        for _ in range(1 + i % 2):
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=8, temperature=1.0
            )
            text = reply.choices[0].message.content or ""
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": "More."},
            ]
        # one task, rewards spread over [0, 1]: each batch is a GRPO group with advantages
        self.server.reward(created["session_id"], min(len(text), 40) / 40)
        self.server.end(created["session_id"])


def other(name: str) -> str:
    return {"a": "b", "b": "a"}[name]


def engine_url(server: Server) -> str:
    (engine,) = server.http.get("/admin/engines").json()
    return engine["url"]


def engine_adapters(server: Server) -> set[str]:
    cards = httpx.get(f"{engine_url(server)}/v1/models", timeout=30).json()["data"]
    return {card["id"] for card in cards if card.get("parent")}


def base_input_logprobs(server: Server, prompt_ids: list[int]) -> list[float]:
    """The engine's own logprobs of the fixed prompt's tokens, no adapter: the base model."""
    reply = httpx.post(
        f"{engine_url(server)}/generate",
        json={
            "input_ids": prompt_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    entries = reply.json()["meta_info"]["input_token_logprobs"]
    return [entry[0] for entry in entries if entry[0] is not None]


def reference(base_dir: Path, adapter_dir: Path | None):
    """The float64 model a version is sampled from: the base with that adapter merged (peft's
    ``merge_and_unload``: W0 + (alpha/r) B A); None: the base."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64).eval()
    if adapter_dir is None:
        return model
    with warnings.catch_warnings():  # peft reads an attribute transformers 5 deprecates
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload().eval()


def versions(base_dir: Path, out: Path, base) -> dict:
    """Version 0 (the base) and each version the run's trainer published, as float64 models."""
    adapters = {int(path.name[1:]): path for path in sorted((out / "weights").glob("v*"))}
    return {0: base} | {v: reference(base_dir, path) for v, path in adapters.items()}


def gaps(model, turn: dict, version: int) -> list[float]:
    """The gaps to ``model``'s float64 forward of the turn's tokens that carry ``version``."""
    expected = teacher_forced_logprobs(model, turn["prompt_ids"], turn["completion_ids"], 1.0)
    pairs = zip(turn["logprobs"], expected, turn["versions"], strict=True)
    return [abs(lp - e) for lp, e, v in pairs if v == version]


def token_checks(sessions: dict[str, dict], models: dict, others: dict) -> dict:
    """Over every completion token of a run's sessions: the largest gap to the float64 forward
    of the version it carries (which must be one of the run's); and, per trained version that
    sampled, the largest gap its tokens would have under the base and under the other run's
    adapter of that version: the smallest of those over the versions."""
    figures = {"tokens": 0, "adapted_tokens": 0, "gap": 0.0}
    base_gaps: dict[int, float] = {}
    other_run_gaps: dict[int, float] = {}
    for turn in (turn for detail in sessions.values() for turn in detail["turns"]):
        assert set(turn["versions"]) <= set(models), (turn["versions"], sorted(models))
        for version in set(turn["versions"]):
            own = gaps(models[version], turn, version)
            figures["tokens"] += len(own)
            figures["gap"] = max(figures["gap"], *own)
            if version > 0:
                figures["adapted_tokens"] += len(own)
                base = max(gaps(models[0], turn, version))
                other_run = max(gaps(others[version], turn, version))
                base_gaps[version] = max(base_gaps.get(version, 0.0), base)
                other_run_gaps[version] = max(other_run_gaps.get(version, 0.0), other_run)
    figures["versions"] = sorted(base_gaps)
    figures["base_gap"] = min(base_gaps.values(), default=0.0)
    figures["other_run_gap"] = min(other_run_gaps.values(), default=0.0)
    return figures


def fixed_prompt_ids(model_dir: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(model_dir)(FIXED_PROMPT)["input_ids"]


@dataclass
class Seen:
    """What the live part left, read before the server stops."""

    runs: dict[str, str]  # name -> run id
    outs: dict[str, Path]  # name -> the trainer's output_dir
    agents: dict[str, Agent]
    steps: dict[str, list[dict]]  # the trainers' metrics.jsonl
    sessions: dict[str, dict[str, dict]]  # name -> every session of the run's agent
    run_state: dict[str, dict]
    held: set[str]  # adapter names the engine holds
    base_before: list[float]
    base_after: list[float]
    seconds: float  # until both trainers finished


def run_live(tiny_model_dir: Path, tmp_path: Path) -> Seen:
    """Both runs' agents and trainers on one proxy, until both trainers finish."""
    with ProxyProcess(tiny_model_dir, tmp_path / "server") as proxy:
        server = Server(proxy)
        runs = {
            name: server.http.post("/rl/runs", json={"name": name, "config": BOUND}).json()["id"]
            for name in ("a", "b")
        }
        prompt_ids = fixed_prompt_ids(tiny_model_dir)
        base_before = base_input_logprobs(server, prompt_ids)
        started = time.monotonic()
        agents = {name: Agent(server, run_id) for name, run_id in runs.items()}
        for agent in agents.values():
            agent.start()
        time.sleep(3)  # a few sessions before the trainers claim
        outs = {name: tmp_path / f"train-{name}" for name in runs}
        trainers = [
            start_trainer(server, outs[name], f"run_id={runs[name]}", *TRAINER) for name in runs
        ]
        try:
            for process in trainers:
                finish(process, timeout=420)
        finally:
            for agent in agents.values():
                agent.stop.set()
            for agent in agents.values():
                agent.join(120)
        return Seen(
            runs=runs,
            outs=outs,
            agents=agents,
            steps={name: metrics(outs[name]) for name in runs},
            sessions={name: {s: server.get(s) for s in agents[name].sessions} for name in runs},
            run_state={name: server.http.get(f"/rl/runs/{r}").json() for name, r in runs.items()},
            held=engine_adapters(server),
            base_before=base_before,
            base_after=base_input_logprobs(server, prompt_ids),
            seconds=time.monotonic() - started,
        )


def check_claims(seen: Seen, name: str) -> None:
    """The run's trainer claimed only the run's sessions; each it claimed is consumed, each it
    did not still waits."""
    claimed = [s for step in seen.steps[name] for s in step["session_ids"]]
    assert [step["step"] for step in seen.steps[name]] == list(range(1, STEPS + 1))
    assert all(step["trained_tokens"] > 0 for step in seen.steps[name]), name
    assert set(claimed) <= set(seen.sessions[name]), name  # none of the other run's
    for session_id, detail in seen.sessions[name].items():
        assert detail["run_id"] == seen.runs[name]
        if session_id in claimed:
            assert detail["status"] == "consumed", (name, detail["status"], detail["drop_reason"])
        else:  # not trained, and not lost: still waiting for a trainer
            assert detail["status"] in ("open", "ended", "trainable"), (name, detail["status"])


def test_two_lora_runs_each_trained_live_by_its_own_trainer(tiny_model_dir, tmp_path):
    seen = run_live(tiny_model_dir, tmp_path)
    runs = seen.runs
    for agent in seen.agents.values():
        assert not agent.errors, agent.errors

    # each trainer claims only its own run's sessions, each once over both trainers
    every = [s for name in runs for step in seen.steps[name] for s in step["session_ids"]]
    assert len(every) == len(set(every)), Counter(every).most_common(3)
    for name in runs:
        check_claims(seen, name)

    # each run's versions are adapters, loaded by name beside the other run's; the base stays
    for name, run_id in runs.items():
        assert seen.run_state[name]["policy_version"] == STEPS, seen.run_state[name]
        assert seen.steps[name][-1]["version"] == STEPS
        mine = {n for n in seen.held if n.startswith(f"{run_id}@")}
        assert f"{run_id}@{STEPS}" in mine, seen.held
        assert {int(n.split("@")[1]) for n in mine} <= set(range(1, STEPS + 1)), seen.held
    pairs = zip(seen.base_before, seen.base_after, strict=True)
    assert len(seen.base_before) > 3
    assert max(abs(a - b) for a, b in pairs) < BASE_TOLERANCE

    # every token: a version its run published, sampled from base + that version's adapter
    base = reference(tiny_model_dir, None)
    models = {name: versions(tiny_model_dir, seen.outs[name], base) for name in runs}
    for name in runs:
        assert sorted(models[name]) == list(range(STEPS + 1)), name  # all kept on disk
    checked = {
        name: token_checks(seen.sessions[name], models[name], models[other(name)]) for name in runs
    }
    print(f"trainers done after {seen.seconds:.0f} s; per run: {checked}")
    for name, figures in checked.items():
        assert figures["gap"] < LOGPROB_TOLERANCE, (name, figures)
        assert figures["adapted_tokens"] > 0, (name, figures)  # tokens of trained versions
        # the check tells the models apart: the base, or the other run's adapter, would not fit
        assert figures["base_gap"] > 100 * LOGPROB_TOLERANCE, (name, figures)
        assert figures["other_run_gap"] > 100 * LOGPROB_TOLERANCE, (name, figures)
