"""The command tree of ``proxrl``: each subcommand a pydantic model whose fields are its flags
(pydantic-settings parses them), whose ``cli_cmd`` runs it.

``server.cli.main`` imports this module once it knows the install can (pydantic-settings comes
with the serve extra); each ``cli_cmd`` imports its role's packages inside ``role_imports`` and
runs outside it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand

from server import cli
from server.cli import refuse, role_imports
from server.engine.settings import EngineSettings
from server.export.options import SINCE_HELP, STATUS_HELP, ExportFormat, ExportStatus, Since
from server.settings import ServerSettings, env_name


class ModelInit(BaseModel):
    """Create proxrl's tiny model (tokenizer + randomly initialised LM) in OUT_DIR, offline;
    --warm-start: the demo's model instead, which can already add a little."""

    out_dir: CliPositionalArg[Path] = Field(description="Directory to write the model into.")
    size: Literal["tiny", "small"] = Field(
        "tiny", description="tiny: ~1.7M parameters; small: ~13M parameters."
    )
    template: Literal["default", "reasoning"] = Field(
        "default",
        description="The chat template. reasoning: Qwen3-style, answers open with "
        "<think>...</think> (tokens of their own), history renders without it.",
    )
    context: int | None = Field(
        None,
        ge=128,  # tiny_model.MIN_CONTEXT and MAX_CONTEXT, which it checks again
        le=1 << 20,
        description="The context length in tokens (max_position_embeddings and the tokenizer's "
        "model_max_length; default: the size's own, tiny 2048, small 4096). The engine serves "
        "prompts up to it, prefilling them in chunks; its KV cache grows with the longest.",
    )
    warm_start: bool = Field(
        False,
        description="Start from the demo's model: the tiny model after the demo's supervised "
        "warm-up on an addition task (examples/agents/warm_start.py; about 0.55 of sums right, "
        "greedy), cached under .proxrl-cache/. Needs the trainer's packages and a clone of proxrl.",
    )

    def cli_cmd(self) -> None:
        with role_imports("model"):
            from server.common.tiny_model import create_tiny_model, parameter_count, set_context

        if self.warm_start:
            out = self.warm_started()
            if self.context is not None:
                set_context(out, self.context)
            print(
                f"wrote the tiny model after the demo's warm-up on addition "
                f"({parameter_count(out):,} parameters; it gets about half the sums right, so "
                f"an exact-match reward has something to reinforce) to {out}"
            )
            return
        with role_imports("model"):  # its first lines import torch and transformers; seconds
            out = create_tiny_model(self.out_dir, self.size, self.template, self.context)
        context = f", context {self.context:,}" if self.context is not None else ""
        print(
            f"wrote the {self.size} model ({parameter_count(out):,} parameters, "
            f"{self.template} chat template{context}) to {out}\n"
            "Its weights are random: it answers nothing right yet, so an exact-match reward "
            "stays 0 and RL has nothing to reinforce. For a model that can already add a "
            f"little (the demo's): proxrl model init {self.out_dir} --warm-start"
        )

    def warm_started(self) -> Path:
        """The demo's warmed-up model (``examples/agents/warm_start.py``), copied to OUT_DIR."""
        import shutil

        if (self.size, self.template) != ("tiny", "default"):
            refuse(
                "proxrl model init: --warm-start makes the tiny model with the default chat "
                "template (the demo's); leave out --size and --template"
            )
        with role_imports("model"):
            warm_start = cli.source_tree_module("warm_start", "model init --warm-start")
        cached = warm_start.warm_model(warm_start.CACHE_DIR, seed=0)
        shutil.copytree(cached, self.out_dir, dirs_exist_ok=True)
        return self.out_dir


class ModelCommands(BaseModel):
    """Create and inspect models."""

    init: CliSubCommand[ModelInit] = Field(description=ModelInit.__doc__)

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def env_in_help(command: type[BaseSettings]) -> type[BaseSettings]:
    """Name each flag's environment variable in its help (``--port`` reads ``PROXRL_PORT``):
    the command's own copies of the fields, so the settings class itself stays as it is."""
    for name, field in command.model_fields.items():
        field.description = f"{field.description} [env {env_name(command, name)}]"
    return command


@env_in_help
class EngineCommand(EngineSettings):
    __doc__ = EngineSettings.__doc__

    def cli_cmd(self) -> None:
        with role_imports("engine"):
            from server.engine.main import serve

        serve(EngineSettings(**self.model_dump()))


@env_in_help
class ServeCommand(ServerSettings):
    __doc__ = ServerSettings.__doc__

    def cli_cmd(self) -> None:
        with role_imports("serve"):
            from server.main import serve

        serve(ServerSettings(**self.model_dump()))


class DbMigrate(BaseModel):
    db: str = Field(description="SQLAlchemy URL of the store, e.g. sqlite:///data/proxrl.db.")
    revision: str | None = Field(None, description="Target revision (default: head / base).")

    @field_validator("db")
    @classmethod
    def _supported(cls, value: str) -> str:
        with role_imports("db"):
            from server.store.database import url_problem

        problem = url_problem(value)  # serve's rule for --db, one definition
        if problem is not None:
            raise ValueError(problem)
        return value


class DbUpgrade(DbMigrate):
    """Apply the store's migrations up to head (the server also does this at start)."""

    def cli_cmd(self) -> None:
        with role_imports("db"):
            from server.store.database import upgrade

        upgrade(self.db, self.revision or "head")
        print(f"{self.db}: upgraded to {self.revision or 'head'}")


class DbDowngrade(DbMigrate):
    """Undo the store's migrations down to a revision (default: base, an empty database)."""

    def cli_cmd(self) -> None:
        with role_imports("db"):
            from server.store.database import downgrade

        downgrade(self.db, self.revision or "base")
        print(f"{self.db}: downgraded to {self.revision or 'base'}")


class DbCommands(BaseModel):
    """Migrate the trajectory store."""

    upgrade: CliSubCommand[DbUpgrade] = Field(description=DbUpgrade.__doc__)
    downgrade: CliSubCommand[DbDowngrade] = Field(description=DbDowngrade.__doc__)

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class TrainCommand(BaseModel):
    """Train a run with asynchronous decoupled PPO (Ray + FSDP2); `proxrl train --help`."""

    def cli_cmd(self) -> None:  # `main` hands `train` to the trainer's own parser
        cli.main(["train"])


class DemoCommand(BaseModel):
    """Watch an agent learn: warm up the tiny model, serve it, run the math agent, train it live
    (`make demo`); `proxrl demo --help`."""

    def cli_cmd(self) -> None:  # `main` hands `demo` to the demo's own parser
        cli.main(["demo"])


RUN_HELP = (
    "a run's id (run-...) or its name (the server's first run is 'default'); the dashboard's "
    "runs page (/admin/runs) lists both, and so does GET /rl/runs with the admin key"
)


class ExportCommand(BaseModel):
    """Write a run's sessions with their turns (token ids, logprobs, versions, rewards, loss
    masks, messages) to a JSONL or Parquet file that `datasets.load_dataset` reads as it is.
    Reads the store directly (the server may be running); GET /rl/runs/{id}/export serves the
    same file over HTTP."""

    out: CliPositionalArg[Path] = Field(description="The file to write (replaced at the end).")
    run: str = Field(description=f"The run: {RUN_HELP}.")
    status: ExportStatus = Field("consumed", description=STATUS_HELP)
    since: Since | None = Field(None, description=SINCE_HELP)
    format: ExportFormat = Field(description="jsonl, or parquet (needs proxrl[export]).")
    db: str | None = Field(None, description=ServerSettings.model_fields["db"].description)
    data_dir: Path = Field(
        Path("data"), description=ServerSettings.model_fields["data_dir"].description
    )

    def cli_cmd(self) -> None:
        import asyncio

        with role_imports("export"):
            from server.common.progress import progress_bar
            from server.errors import ProxrlError, RunNotFound
            from server.export.writers import FORMATS
            from server.rl.export import chosen_sessions, export_file
            from server.store.database import default_url, revision_mismatch, sqlite_file

        url = self.db or default_url(self.data_dir)
        store = sqlite_file(url)
        if store is not None and not store.is_file():  # connecting would create an empty one
            raise SystemExit(f"proxrl export: no store at {store} (give --db or --data-dir)")
        mismatch = revision_mismatch(url)  # the server upgrades its store; this reads it as is
        if mismatch is not None:
            raise SystemExit(
                f"proxrl export: the store is {mismatch}: run `proxrl db upgrade --db URL` (or "
                "start this proxrl's server on it) first"
            )
        skipped: list[tuple[str, str]] = []
        with progress_bar("exporting {task.description}", "sessions") as progress:
            task = progress.add_task(self.run, total=None)
            try:
                written = asyncio.run(
                    export_file(
                        url,
                        chosen_sessions(self.run, self.status, self.since),
                        FORMATS[self.format](),
                        self.out,
                        on_total=lambda total: progress.update(task, total=total),
                        on_page=lambda sessions: progress.advance(task, sessions),
                        on_skip=lambda session_id, reason: skipped.append((session_id, reason)),
                    )
                )
            except RunNotFound:
                raise SystemExit(
                    f"proxrl export: no run {self.run!r} in the store; --run takes {RUN_HELP}"
                ) from None
            except ProxrlError as exc:
                raise SystemExit(f"proxrl export: {exc.message}") from None
            except OSError as exc:  # the file could not be written (a full disk, no access)
                raise SystemExit(f"proxrl export: {self.out}: {exc.strerror or exc}") from None
        print(f"wrote {written} session(s) to {self.out}", file=sys.stderr)
        for session_id, reason in skipped:
            print(f"skipped session {session_id}: {reason}", file=sys.stderr)
        if skipped:
            print(f"skipped {len(skipped)} session(s) no file can carry", file=sys.stderr)


class Proxrl(
    BaseSettings,
    cli_prog_name="proxrl",
    cli_kebab_case=True,
    cli_implicit_flags=True,
):
    """proxrl: an OpenAI-compatible RL-as-a-service proxy. Point an agent at it, post rewards,
    and it trains the model behind it with asynchronous decoupled PPO."""

    model: CliSubCommand[ModelCommands] = Field(description=ModelCommands.__doc__)
    engine: CliSubCommand[EngineCommand] = Field(
        description="Serve a model with the embedded CPU/CUDA engine (SGLang's native HTTP API)."
    )
    serve: CliSubCommand[ServeCommand] = Field(
        description="The proxy: OpenAI-compatible serving, sessions, rewards, the store."
    )
    train: CliSubCommand[TrainCommand] = Field(description=TrainCommand.__doc__)
    db: CliSubCommand[DbCommands] = Field(description=DbCommands.__doc__)
    demo: CliSubCommand[DemoCommand] = Field(description=DemoCommand.__doc__)
    export: CliSubCommand[ExportCommand] = Field(description=ExportCommand.__doc__)

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def run_command(args: list[str]) -> None:
    """Parse ``args`` (``proxrl`` left out) and run the command they name."""
    try:
        CliApp.run(Proxrl, cli_args=args)
    except ValidationError as exc:
        for error in exc.errors():
            print(invalid_line(error["loc"], error["type"], error["msg"]), file=sys.stderr)
        raise SystemExit(2) from None


def invalid_line(loc: tuple[int | str, ...], kind: str, message: str) -> str:
    """One line for a value pydantic refused: a required flag that is missing names the flag and,
    for the commands that read the environment, its variable (which `--help` also lists)."""
    if kind != "missing" or len(loc) < 2:
        return f"proxrl: invalid {'.'.join(str(p) for p in loc)}: {message}"
    command: Any = Proxrl
    for name in loc[:-1]:
        annotation = command.model_fields[str(name)].annotation
        command = next(c for c in get_args(annotation) if c is not type(None))
    field = str(loc[-1])
    line = f"proxrl {' '.join(str(p) for p in loc[:-1])}: --{field.replace('_', '-')} is required"
    if not issubclass(command, BaseSettings):  # reads no environment
        return line
    return f"{line} (or set {env_name(command, field)})"
