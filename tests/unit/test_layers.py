"""The import rules between our packages, read from the source.

Every module of ``server/``, ``trainer/``, ``client_sdk/``, ``bench/`` and ``tools/`` is parsed with
``ast`` and each of its imports (at the top, inside functions, under ``TYPE_CHECKING``) is held
to ``LAYERS``: which parts of the project a layer may import. Data flows one way
(docs/architecture/index.md): the proxy reaches the engines only through the engine client, the
store knows nothing above it, the engine nothing of the proxy, and the trainer reaches the server
over HTTP, importing only ``server.common``. A module under ``server/`` that belongs to no layer
fails: a new folder must be placed in the table first.

A subprocess check adds what the source alone cannot show: importing the whole proxy
(``server.main``) or the command line (``server.cli``) loads neither torch, ray nor transformers.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import ROOT

PACKAGES = ("server", "trainer", "client_sdk", "bench", "tools")
OURS = {*PACKAGES, "tests", "examples"}

# The app shell: server/'s top-level modules (and the command line's package, server/cli/).
# They compose the layers and may import any of them.
SHELL = [
    "server",
    "server.auth",
    "server.bounds",
    "server.cli",
    "server.cli.__main__",
    "server.cli.commands",
    "server.context",
    "server.deps",
    "server.limits",
    "server.main",
    "server.metrics",
    "server.overload",
    "server.settings",
    "server.startup",
]
SERVER_LAYERS = [
    "server.errors",
    "server.text",
    "server.common",
    "server.store",
    "server.engine",
    "server.engine_client",
    "server.proxy",
    "server.rl",
    "server.dashboard",
    "server.export",
]

# layer -> the layers (besides itself) it may import. A layer is a package (all its modules) or,
# for the shell, one module. "server.errors" is the one error tree: every server layer but
# server.common may raise from it (server.common is all the trainer imports of the server).
LAYERS: dict[str, set[str]] = {
    "server.errors": set(),
    "server.common": set(),
    "server.text": {"server.errors"},
    "server.store": {"server.errors"},
    # Export files (schema, JSONL and Parquet writers): plain records in, bytes out.
    "server.export": {"server.errors", "server.common"},
    "server.engine": {"server.text", "server.common", "server.errors"},
    "server.engine_client": {"server.common", "server.errors"},
    "server.proxy": {
        "server.engine_client", "server.store", "server.text", "server.common", "server.errors",
        "server.context", "server.deps", "server.auth", "server.bounds", "server.metrics",
        "server.settings",
    },
    "server.rl": {
        "server.engine_client", "server.store", "server.common", "server.errors", "server.export",
        "server.context", "server.deps", "server.auth", "server.bounds", "server.metrics",
        "server.settings",
    },
    "server.dashboard": {
        "server.rl", "server.store", "server.engine_client", "server.errors",
        "server.context", "server.deps", "server.auth", "server.bounds", "server.metrics",
        "server.settings",
    },
    **{shell: {*SHELL, *SERVER_LAYERS} for shell in SHELL},
    "trainer": {"server.common"},
    "client_sdk": set(),
    "bench": {"server", *SHELL, *SERVER_LAYERS, "trainer", "client_sdk"},
    # Developer tools (the reference pages' generator): read anything of ours but the tests.
    "tools": {"server", *SHELL, *SERVER_LAYERS, "trainer", "client_sdk"},
}  # fmt: skip

# Imports a layer's table does not grant, allowed for one module: the `proxrl train` entry
# point hands over to the trainer (inside the command, so `proxrl serve` never loads it).
LAZY_EXCEPTIONS = {("server.cli", "trainer")}

# Outside server/store, SQL is written nowhere: only the shell's connection plumbing imports
# sqlalchemy (to open the database and hand out sessions), and the dashboard benchmark, which
# seeds a large store row by row as its fixture.
SQLALCHEMY_ALLOWED = {"server.context", "server.startup", "server.main", "bench.dashboard"}

# torch, ray and transformers: the trainer, the embedded engine, the tiny model and weight
# transfer (server.common, each module importing them itself) and benchmarks only.
HEAVY = {"torch", "ray", "transformers"}
HEAVY_ALLOWED = ("trainer", "server.engine", "server.common", "bench")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # what it imports, resolved to a module where it names one
    lazy: bool  # inside a function


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def our_modules() -> dict[str, Path]:
    return {
        module_name(path): path
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
    }


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def is_package_folder(name: str) -> bool:  # bench/ is a folder of scripts, no __init__.py
    return ROOT.joinpath(*name.split(".")).is_dir()


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import in ``path``; ``from package import name`` resolves to ``package.name``
    where that is a module of ours."""
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(module, alias.name, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.append(Import(module, name if is_module(name) else base, lazy))
        nested = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, nested)

    visit(ast.parse(path.read_text(), str(path)), lazy=False)
    return found


def layer_of(module: str) -> str | None:
    """The entry of ``LAYERS`` that ``module`` belongs to: the shell's modules by name, every
    other layer by package prefix."""
    if module in SHELL:
        return module
    for layer in LAYERS:
        if layer not in SHELL and (module == layer or module.startswith(layer + ".")):
            return layer
    return None


def violations_of(item: Import) -> list[str]:
    root = item.target.split(".")[0]
    rules: list[str] = []
    source = layer_of(item.module)
    if root in OURS:
        target = layer_of(item.target)
        allowed = target == source or (source is not None and target in LAYERS[source])
        if not allowed and not (item.lazy and (item.module, root) in LAZY_EXCEPTIONS):
            rules.append(f"{source} may not import {target or root}")
    if root == "sqlalchemy" and not (source == "server.store" or item.module in SQLALCHEMY_ALLOWED):
        rules.append("SQL lives in server.store")
    if root in HEAVY and not any(
        item.module == layer or item.module.startswith(layer + ".") for layer in HEAVY_ALLOWED
    ):
        rules.append(f"only {', '.join(HEAVY_ALLOWED)} import torch, ray or transformers")
    return [f"{item.module} -> {item.target} ({rule})" for rule in rules]


def test_every_import_follows_the_table():
    violations = sorted(
        {
            violation
            for module, path in our_modules().items()
            for item in imports_of(module, path)
            for violation in violations_of(item)
        }
    )
    assert not violations, "imports against the table:\n" + "\n".join(violations)


def test_every_server_module_belongs_to_a_layer():
    unplaced = [module for module in our_modules() if layer_of(module) is None]
    assert not unplaced, f"modules in no layer of LAYERS (place them first): {unplaced}"


def test_the_top_level_is_the_app_shell_only():
    """server/ keeps at most 11 modules beside its folders: the shell (the layers hold the rest)."""
    top = sorted(p.stem for p in (ROOT / "server").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 11, top
    assert {f"server.{name}" for name in top} <= {*SHELL, "server.errors"}


def test_the_table_names_only_layers():
    named = {layer for allowed in LAYERS.values() for layer in allowed}
    assert named <= {*LAYERS, "server"}, named - set(LAYERS)
    gone = [layer for layer in LAYERS if not (is_module(layer) or is_package_folder(layer))]
    assert not gone, f"layers of LAYERS that no longer exist: {gone}"


def test_the_rules_catch_what_they_forbid():
    """The checker itself, on imports the table forbids and allows."""

    def broken(module: str, target: str, lazy: bool = False) -> bool:
        return bool(violations_of(Import(module, target, lazy)))

    assert broken("server.store.sessions", "server.proxy.session_cache")
    assert broken("server.engine.runner", "server.proxy.generation")
    assert broken("server.proxy.chat", "server.rl.sessions")
    assert broken("server.proxy.chat", "sqlalchemy")
    assert broken("server.proxy.chat", "torch", lazy=True)
    assert broken("trainer.run", "server.store.tables")
    assert broken("bench.proxy", "tests.support")
    assert broken("tools.docs_reference.cli", "tests.support")
    assert broken("client_sdk._client", "server.errors")
    assert broken("server.cli", "trainer.cli")  # at the top: `proxrl serve` would load it
    assert not broken("server.cli", "trainer.cli", lazy=True)
    assert not broken("server.proxy.chat", "server.engine_client.pool")
    assert not broken("trainer.run", "server.common.processes")


def loaded_by(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["server.main", "server.cli", "server.cli.commands"])
def test_the_proxy_loads_neither_torch_ray_nor_transformers(module):
    heavy = sorted(name for name in loaded_by(module) if name.split(".")[0] in HEAVY)
    assert not heavy, f"import {module} loads {heavy[:10]}"


# The algorithm (trainer/algorithm.py) and the step's plan reach the model only through
# trainer/backend.py: neither they nor any module of ours they import (transitively) names
# torch.distributed, FSDP or Ray. The plan is plain data: no torch at all.
BACKEND_ONLY = ("torch.distributed", "ray")
PURE = ("trainer.plan", "trainer.algorithm")


def imported_by(module: str) -> list[Import]:
    """Every import of ``module`` and of the modules of ours it imports, transitively."""
    modules = our_modules()
    seen, todo, found = {module}, [module], []
    while todo:
        current = todo.pop()
        for item in imports_of(current, modules[current]):
            found.append(item)
            if item.target in modules and item.target not in seen:
                seen.add(item.target)
                todo.append(item.target)
    return found


def reaches_a_backend(item: Import) -> bool:
    target = item.target
    return "fsdp" in target.lower() or any(
        target == name or target.startswith(name + ".") for name in BACKEND_ONLY
    )


@pytest.mark.parametrize("module", PURE)
def test_the_algorithm_and_the_plan_import_no_distributed_backend(module):
    found = sorted(
        {f"{i.module} -> {i.target}" for i in imported_by(module) if reaches_a_backend(i)}
    )
    assert not found, f"{module} reaches the backend's machinery: {found}"


def test_the_backend_check_catches_what_it_forbids():
    def caught(target: str) -> bool:
        return reaches_a_backend(Import("trainer.algorithm", target, lazy=True))

    assert caught("torch.distributed")
    assert caught("torch.distributed.fsdp")
    assert caught("ray")
    assert not caught("torch")
    assert not caught("trainer.backend")
    # trainer.publish names none of them itself, only through the modules it imports
    assert not any(
        reaches_a_backend(i)
        for i in imported_by("trainer.publish")
        if i.module == "trainer.publish"
    )
    assert any(reaches_a_backend(i) for i in imported_by("trainer.publish"))


def test_the_plan_loads_no_torch():
    heavy = sorted(name for name in loaded_by("trainer.plan") if name.split(".")[0] in HEAVY)
    assert not heavy, f"import trainer.plan loads {heavy[:10]}"
