"""The ``proxrl`` command line: one entry point, one subcommand per job.

Importing this package loads nothing beyond the standard library. ``main`` first imports what
the command needs to parse (the command tree, ``server/cli/commands.py``: pydantic-settings and
the settings classes; ``train`` and ``demo`` have parsers of their own), then parses and runs.
A package missing from the install is one line naming the extra to install, exit 2, but only
while importing: ``role_imports`` wraps that phase and each command's own imports of its role's
packages, never the work itself, so a ModuleNotFoundError hours into a run stays the bug it is.
Subcommands import what they need when they run, so ``proxrl --help`` stays instant and the
proxy's commands never import torch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

# The extra (pyproject.toml) that brings each subcommand's packages, and the optional packages
# a command loads only when asked; tests/unit/test_extras.py holds both to the extras.
COMMAND_EXTRAS = {
    "model": "engine",
    "engine": "engine",
    "serve": "serve",
    "db": "serve",
    "export": "serve",
    "train": "train",
    "demo": "all",
}
OPTIONAL_EXTRAS = {"wandb": "wandb", "mlflow": "mlflow", "pyarrow": "export", "openai": "openai"}
OURS = {"server", "trainer", "client_sdk", "examples"}


def missing_extra(exc: ModuleNotFoundError, command: str) -> NoReturn:
    """One line naming the extra to install, exit 2; a module of ours missing is a bug: raise."""
    package = (exc.name or "").split(".")[0]
    if not package or package in OURS:
        raise exc
    extra = OPTIONAL_EXTRAS.get(package) or COMMAND_EXTRAS.get(command, "serve")
    print(
        f"proxrl {command}: {package} is not installed: pip install 'proxrl[{extra}]'",
        file=sys.stderr,
    )
    raise SystemExit(2)


@contextlib.contextmanager
def role_imports(command: str) -> Iterator[None]:
    """Around imports only: a package the install lacks names the extra (``missing_extra``)."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing_extra(exc, command)


def refuse(line: str) -> NoReturn:
    """A refusal: one line to stderr, exit 2 (the status of every refusal of ``proxrl``)."""
    print(line, file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        args = ["--help"]
    command = args[0]
    if command == "train":  # its options come from the trainer's dataclasses, not pydantic
        with role_imports(command):
            from trainer.cli import main as train_main
        train_main(args[1:])
        return
    if command == "demo":  # so is the demo's: argparse in examples/demo.py
        run_demo(args[1:])
    with role_imports(command):
        from server.cli.commands import run_command
    run_command(args)


SOURCE_TREE = Path(__file__).resolve().parents[2]
DEMO_SCRIPT = SOURCE_TREE / "examples" / "demo.py"
DEMO_LORA_SCRIPT = SOURCE_TREE / "examples" / "demo_lora.py"  # proxrl demo --lora


def need_clone_file(path: Path, command: str) -> None:
    """Refuse, in one line, a command whose example file is not here: the examples are not part
    of the installed packages, so it runs from a clone of proxrl."""
    if not path.is_file():
        refuse(
            f"proxrl {command}: {path} is missing; it runs from a clone of proxrl "
            "(pip install -e .)"
        )


def source_tree_module(name: str, command: str) -> Any:
    """``examples/agents/<name>.py`` of this source tree, imported as the agents import each
    other (the examples are not part of the installed packages)."""
    import importlib

    agents = SOURCE_TREE / "examples" / "agents"
    need_clone_file(agents / f"{name}.py", command)
    if str(agents) not in sys.path:
        sys.path.insert(0, str(agents))
    return importlib.import_module(name)


def run_demo(args: list[str]) -> NoReturn:
    """Run ``examples/demo.py`` of this source tree (the demo and its agents are examples, not
    part of the installed packages): its imports first, then its ``main``. With ``--lora``,
    ``examples/demo_lora.py`` instead: two LoRA runs on one engine, one rolled back."""
    import runpy

    script = DEMO_LORA_SCRIPT if "--lora" in args else DEMO_SCRIPT
    need_clone_file(script, "demo")
    with role_imports("demo"):  # as a module, not as __main__: this runs its imports only
        demo = runpy.run_path(str(script), run_name="proxrl_demo")
    raise SystemExit(demo["main"]([arg for arg in args if arg != "--lora"]))
