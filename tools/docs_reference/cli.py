"""``reference/cli.md``: every ``proxrl`` subcommand and every flag.

Read from the parsers the command itself builds: pydantic-settings' parser of
``server.cli.commands.Proxrl`` for the subcommands and their flags (each flag's type, default and
help from the settings field behind it), and the argparse parsers of the subcommands ``proxrl``
hands over to (``train``, ``demo``). Knows nothing of what a flag does.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, CliSettingsSource

from server.cli import DEMO_SCRIPT
from server.cli.commands import Proxrl
from server.settings import env_name
from tools.docs_reference import markdown as md
from trainer import cli as trainer_cli

SOURCES = [
    "server/cli/commands.py",
    "server/settings.py",
    "server/engine/settings.py",
    "trainer/cli.py",
]


@dataclass(frozen=True)
class Flag:
    names: str  # "--port", "--x, --no-x", or "OUT_DIR" for a positional argument
    type: str
    default: str  # Markdown; "" when required, "—" when none
    required: bool
    env: str | None  # the environment variable that also sets it
    help: str


@dataclass(frozen=True)
class Command:
    prog: str  # "proxrl serve"
    description: str
    flags: list[Flag]
    note: str = ""  # Markdown after the table


def demo_parser() -> argparse.ArgumentParser:
    """The demo's parser. ``examples/demo.py`` builds it and parses in one call, so it is caught
    as it parses (the demo's module runs as a module, not as ``__main__``: nothing starts)."""

    class Caught(Exception):
        pass

    def catch(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise Caught(self)

    path = list(sys.path)
    try:
        demo = runpy.run_path(str(DEMO_SCRIPT), run_name="proxrl_demo_reference")
    finally:
        sys.path[:] = path  # the demo puts examples/agents on it
    parse = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = catch  # type: ignore[method-assign,assignment]
    try:
        demo["parse_args"]([])
    except Caught as caught:
        return caught.args[0]
    finally:
        argparse.ArgumentParser.parse_args = parse  # type: ignore[method-assign]
    raise AssertionError("examples/demo.py's parse_args parsed nothing")


# The subcommands ``server.cli.main`` hands to a parser of their own, with what their page adds.
HANDED_OVER: dict[str, tuple[Callable[[], argparse.ArgumentParser], str]] = {
    "train": (
        trainer_cli.parser,
        "Every key of the [trainer config](config.md#trainer-config) is also an argument "
        "`key=value` (nested keys dotted: `algorithm.eps_clip=0.3`), applied after `--config` "
        "in order.",
    ),
    "demo": (demo_parser, ""),
}


def commands(root: type[BaseSettings] = Proxrl) -> list[Command]:
    """Every command under ``root``, depth first in the order the parser lists them."""
    return list(_walk(CliSettingsSource(root).root_parser, root))


def _walk(parser: argparse.ArgumentParser, model: type[BaseModel]) -> Iterator[Command]:
    flags, subcommands = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            subcommands += list(action.choices.items())
        elif not isinstance(action, argparse._HelpAction):
            name = action.dest.rsplit(".", 1)[-1]
            flags.append(_settings_flag(action, model, model.model_fields[name], name))
    prog = parser.prog
    handed = HANDED_OVER.get(prog.partition(" ")[2])  # "proxrl train" -> "train"
    if handed is not None:
        build, note = handed
        yield _argparse_command(build(), note)
    elif flags or not subcommands:
        yield Command(prog, parser.description or "", flags)
    for name, sub in subcommands:
        yield from _walk(sub, _model_of(model.model_fields[name.replace("-", "_")]))


def _model_of(field: FieldInfo) -> type[BaseModel]:
    """The model of a subcommand field (``CliSubCommand[X]`` is ``X | None``)."""
    for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    raise AssertionError(f"no model in {field.annotation!r}")


def _settings_flag(
    action: argparse.Action, model: type[BaseModel], field: FieldInfo, name: str
) -> Flag:
    positional = not action.option_strings
    # The field's, not argparse's: the parser leaves every flag optional so that a variable
    # (PROXRL_MODEL) can give what a flag does not.
    required = field.is_required()
    env = env_name(model, name) if issubclass(model, BaseSettings) else None
    return Flag(
        names=str(action.metavar) if positional else ", ".join(action.option_strings),
        type=md.type_name(field.annotation),
        default="" if required else md.value(field.get_default(call_default_factory=True)),
        required=required,
        env=env,
        help=field.description or "",
    )


def _argparse_command(parser: argparse.ArgumentParser, note: str) -> Command:
    flags = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = ", ".join(action.option_strings) or str(action.metavar or action.dest)
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            kind = "flag"
        else:
            kind = getattr(action.type, "__name__", "str")
        if action.nargs in ("*", "+"):
            kind = f"list of {kind}"
        flags.append(
            Flag(
                names=names,
                type=kind,
                default="—" if action.default is None else md.value(action.default),
                required=action.required,
                env=None,
                help=action.help or "",
            )
        )
    return Command(parser.prog, parser.description or "", flags, note)


def render(found: list[Command]) -> str:
    intro = (
        "`proxrl` is one command with a subcommand per job; `proxrl SUBCOMMAND --help` prints "
        "the same options. For `proxrl serve` and `proxrl engine`, every flag can also come from "
        "the environment variable beside it (flags win; see [Environment](environment.md)); an "
        "invalid value stops the command at start and names the flag."
    )
    blocks = [
        md.head("Command line", SOURCES, intro),
        md.table(
            ["Command", "What it does"],
            [[f"[{md.code(c.prog)}](#{_slug(c.prog)})", md.text(c.description)] for c in found],
        ),
    ]
    for command in found:
        blocks.append(f"## `{command.prog}` {{#{_slug(command.prog)}}}")
        if command.description:
            blocks.append(md.text(command.description))
        if command.flags:
            with_env = any(f.env for f in command.flags)
            headers = ["Flag", "Type", "Default", *(["Environment"] if with_env else []), "Help"]
            blocks.append(md.table(headers, [_row(f, with_env) for f in command.flags]))
        else:
            blocks.append("No options.")
        if command.note:
            blocks.append(command.note)
    return md.join(blocks)


def _row(flag: Flag, with_env: bool) -> list[str]:
    default = "*required*" if flag.required else flag.default
    env = [md.code(flag.env) if flag.env else "—"] if with_env else []
    return [md.code(flag.names), flag.type, default, *env, md.text(flag.help)]


def _slug(prog: str) -> str:
    return prog.replace(" ", "-")


def page() -> str:
    return render(commands())
