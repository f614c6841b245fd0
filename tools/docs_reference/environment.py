"""``reference/environment.md``: every environment variable proxrl's programs read.

Two kinds. The settings of ``proxrl serve`` and ``proxrl engine`` each come from a
pydantic-settings class whose fields are also variables (``env_prefix`` + the field's name); their
tables are made from those classes. Every other variable is read by a line of code
(``os.environ.get``, ``os.getenv``, ``os.environ[...]``, ``... in os.environ``) and described in
``OTHER`` below; ``reads()`` finds those lines in the source, and the page refuses to build while
one reads a variable ``OTHER`` does not describe, or ``OTHER`` describes one nothing reads. Reads
whose name is not a string literal or a module-level string constant (code that saves and
restores variables it sets) are not reads of configuration and are not counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic_settings import BaseSettings

from client_sdk._base import DEFAULT_BASE_URL
from server.engine.settings import EngineSettings
from server.settings import ServerSettings, env_name
from tools.docs_reference import markdown as md
from trainer.failpoints import POINTS

SOURCES = ["server/settings.py", "server/engine/settings.py", "the reads in server/, trainer/, "
           "client_sdk/ and examples/"]  # fmt: skip
# The programs' code: what a user runs (the benchmarks and tests set variables for themselves).
SCANNED = ("server", "trainer", "client_sdk", "examples")
SETTINGS: dict[str, type[BaseSettings]] = {
    "proxrl serve": ServerSettings,
    "proxrl engine": EngineSettings,
}


@dataclass(frozen=True)
class Variable:
    read_by: str
    default: str  # Markdown
    meaning: str


OTHER: dict[str, Variable] = {
    "PROXRL_ADMIN_KEY": Variable(
        "`proxrl train`, the client SDK",
        "—",
        "Besides `proxrl serve`'s `--admin-key`: the trainer's `admin_key` when neither "
        "`--admin-key` nor the config gives one, and the client SDK's key when none is passed.",
    ),
    "PROXRL_BASE_URL": Variable(
        "the client SDK",
        md.code(DEFAULT_BASE_URL),
        "The server's URL when `Client` / `AsyncClient` get no `base_url`.",
    ),
    "PROXRL_TRAINER_PAUSE_AT": Variable(
        "`proxrl train` (tests only)",
        "unset",
        "`POINT@STEP`: the trainer stops dead at that point of that step (writing "
        "`OUTPUT_DIR/paused-at`) so that a crash test can kill it there. Points: "
        + ", ".join(md.code(p) for p in POINTS)
        + " (`mid_step`: inside every worker, each writing `paused-at-rank<R>`).",
    ),
    "PROXRL_TRAINER_PAUSE_DIR": Variable(
        "`proxrl train` (tests only)",
        "`output_dir`",
        "Where `PROXRL_TRAINER_PAUSE_AT` writes its marker: a directory the test sees when the "
        "workers run on other nodes (the driver passes both variables to them).",
    ),
    "PROXRL_WEIGHTS_FAILPOINT": Variable(
        "`proxrl serve` (tests only)",
        "unset",
        "`paused:SECONDS`: each weight swap holds the engines paused that long before loading, "
        "so that a drill can take the lead away or kill the leader mid-swap.",
    ),
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": Variable(
        "`proxrl engine`",
        md.code("true"),
        "SGLang's own variable, honoured by the embedded engine: `0` or `false` makes "
        "`/health` answer from the scheduler being alive instead of generating one token.",
    ),
    "WANDB_DIR": Variable(
        "`proxrl train`",
        "the run's `output_dir`",
        "Where Weights & Biases writes its files when `tracking.wandb` is on.",
    ),
}


class Undocumented(AssertionError):
    """The code reads a variable ``OTHER`` does not describe, or the other way round."""


def reads(root: Path = md.ROOT, packages: Iterable[str] = SCANNED) -> dict[str, list[str]]:
    """Each variable read by name in ``packages`` → the files reading it (relative, sorted)."""
    found: dict[str, set[str]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for name in variables_read(path.read_text()):
                found.setdefault(name, set()).add(path.relative_to(root).as_posix())
    return {name: sorted(files) for name, files in sorted(found.items())}


def variables_read(source: str) -> set[str]:
    """The variables ``source`` reads from ``os.environ`` by a name it spells out."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def name_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return constants.get(node.id) if isinstance(node, ast.Name) else None

    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            if _is_environ(node.func, "get") or _is_os(node.func, "getenv"):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value):
                keys.append(node.slice)
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.ops[0], (ast.In, ast.NotIn))
            and _is_environ(node.comparators[0])
        ):
            keys.append(node.left)
    return {name for name in map(name_of, keys) if name is not None}


def _is_os(node: ast.expr, attribute: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attribute
        and isinstance(node.value, ast.Name)
        and node.value.id == "os"
    )


def _is_environ(node: ast.expr, method: str | None = None) -> bool:
    """``os.environ`` (``method`` None), or ``os.environ.<method>``."""
    if method is not None:
        return isinstance(node, ast.Attribute) and node.attr == method and _is_environ(node.value)
    return _is_os(node, "environ")


def settings_rows(settings: type[BaseSettings]) -> list[list[str]]:
    rows = []
    for name, field in settings.model_fields.items():
        required = field.is_required()
        rows.append(
            [
                md.code(env_name(settings, name)),
                md.code("--" + name.replace("_", "-")),
                md.type_name(field.annotation),
                "*required*" if required else md.value(field.get_default()),
                md.text(field.description),
            ]
        )
    return rows


def render(found: dict[str, list[str]], other: dict[str, Variable]) -> str:
    named = {prefix_name for settings in SETTINGS.values() for prefix_name in _names(settings)}
    unexplained = sorted(set(found) - set(other) - named)
    unread = sorted(set(other) - set(found))
    if unexplained or unread:
        raise Undocumented(
            f"variables read but not described in tools/docs_reference/environment.py OTHER: "
            f"{unexplained or 'none'}; described but read nowhere: {unread or 'none'}"
        )
    intro = (
        "Every variable proxrl's programs read. The settings' variables are matched without regard "
        "to case. A "
        "flag on the command line wins over its variable; an invalid value stops the command "
        "at start and names it."
    )
    blocks = [md.head("Environment variables", SOURCES, intro)]
    headers = ["Variable", "Flag", "Type", "Default", "What it sets"]
    for command, settings in SETTINGS.items():
        prefix = settings.model_config.get("env_prefix") or ""
        blocks += [
            f"## `{command}`",
            f"Every flag of [`{command}`](cli.md#{command.replace(' ', '-')}) is also the "
            f"variable `{prefix}` + its name in capitals.",
            md.table(headers, settings_rows(settings)),
        ]
    shared = _shared()
    if shared:
        blocks.append(
            "Both `proxrl serve` and `proxrl engine` read "
            + ", ".join(md.code(name) for name in shared)
            + " (each for its own setting): set in the environment of a shell that starts both, "
            "it applies to both."
        )
    blocks += [
        "## Other variables",
        "Read by the code that names them (found in the source by `make docs`).",
        md.table(
            ["Variable", "Read by", "Default", "What it does", "Read in"],
            [
                [
                    md.code(name),
                    md.text(v.read_by),
                    v.default,
                    md.text(v.meaning),
                    ", ".join(md.code(f) for f in found[name]),
                ]
                for name, v in sorted(other.items())
            ],
        ),
    ]
    return md.join(blocks)


def _names(settings: type[BaseSettings]) -> set[str]:
    return {env_name(settings, name) for name in settings.model_fields}


def _shared() -> list[str]:
    serve, engine = (_names(s) for s in SETTINGS.values())
    return sorted(serve & engine)


def page() -> str:
    return render(reads(), OTHER)
