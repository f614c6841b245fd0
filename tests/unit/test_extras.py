"""The extras follow the import layers: each role's extra installs every third-party import.

A role is what one kind of install runs: the base install (``client_sdk``), ``serve`` (the proxy,
the store, the dashboard), ``engine`` (the embedded engine and the tiny model), ``train``,
``examples``, ``all`` (the demo) and ``dev`` (tests and benchmarks). Each module's imports (at
the top and inside functions, read with ``ast`` as ``test_layers`` reads them) must name a
package in the closure of the role's extra: its requirements in pyproject.toml, ``proxrl[...]``
followed, then their dependencies as the installed distributions declare them. Optional packages
a command loads only when asked (``server.cli.OPTIONAL_EXTRAS``: a tracker, Parquet) may come
from their own extra instead.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from functools import cache

import pytest
from packaging.requirements import Requirement

from requirements.lockfile import normalized
from server.cli import COMMAND_EXTRAS, OPTIONAL_EXTRAS
from tests.support import ROOT
from tests.unit.test_layers import imports_of, module_name

OURS = {"server", "trainer", "client_sdk", "bench", "tests", "examples"}
# module prefix -> the extra of the install that runs it ("": the base install); longest wins.
ROLES = {
    "client_sdk": "",
    "server": "serve",
    "server.engine": "engine",
    # server.common's modules that load torch serve the engine and the trainer, never the proxy.
    "server.common.tiny_model": "engine",
    "server.common.weight_transfer": "engine",
    "trainer": "train",
    "examples.agents": "examples",
    "examples": "all",  # the demo runs every role
    "examples.agents.warm_start": "all",  # the demo's warm-up (trainer.warmup)
    "bench": "dev",
    "tests": "dev",
}
# Packages a role needs that it never imports by name.
UNIMPORTED = {
    "serve": {"plotly", "aiosqlite", "psycopg"},  # plotly.js served as a file; SQL drivers by URL
    "train": {"tensorboard"},  # through torch.utils.tensorboard
}
# An import that is the caller's: schema.features() hands datasets.Features to code that calls
# datasets.load_dataset, which has datasets already.
CALLERS = {("server.export.schema", "datasets")}
HEAVY = {"torch", "ray", "transformers"}


@cache
def extras() -> dict[str, list[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"": project["dependencies"], **project["optional-dependencies"]}


@cache
def closure(extra: str) -> frozenset[str]:
    """Every distribution ``pip install 'proxrl[extra]'`` installs on this platform."""
    found: set[str] = set(closure("")) if extra else set()  # an extra comes with the base
    pending = [Requirement(spec) for spec in extras()[extra]]
    while pending:
        requirement = pending.pop()
        name = normalized(requirement.name)
        if name == "proxrl":
            found |= closure("") | {d for e in requirement.extras for d in closure(e)}
            continue
        if name in found:
            continue
        found.add(name)
        try:
            declared = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed here (test_lock holds the env to the lock)
        for spec in map(Requirement, declared):
            wanted = {"", *requirement.extras}
            if spec.marker is None or any(spec.marker.evaluate({"extra": e}) for e in wanted):
                pending.append(spec)
    return frozenset(found)


def role_of(module: str) -> str:
    prefixes = [p for p in ROLES if module == p or module.startswith(p + ".")]
    return ROLES[max(prefixes, key=len)]


def third_party_imports() -> dict[tuple[str, str], str]:
    """(module, imported top-level name) -> the module's role, over every module of ours."""
    # Ours too: the repository's top-level folders, and scripts' sibling modules.
    local = {p.stem for p in ROOT.iterdir()} | {
        p.stem for folder in ("examples", "bench", "tests") for p in (ROOT / folder).rglob("*")
    }
    found = {}
    for folder in ("server", "trainer", "client_sdk", "examples", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            module = module_name(path)
            for item in imports_of(module, path):
                root = item.target.split(".")[0]
                if root and root not in OURS | local and root not in sys.stdlib_module_names:
                    found[(module, root)] = role_of(module)
    return found


def test_every_role_installs_what_it_imports():
    providers = importlib.metadata.packages_distributions()
    uncovered = []
    for (module, root), role in sorted(third_party_imports().items()):
        if (module, root) in CALLERS:
            continue
        dists = {normalized(d) for d in providers.get(root, [])}
        assert dists, f"{module} imports {root}, which no installed distribution provides"
        installed = closure(role) | (
            closure(OPTIONAL_EXTRAS[root]) if root in OPTIONAL_EXTRAS else set()
        )
        if not dists & installed:
            uncovered.append(
                f"{module} imports {root} ({', '.join(sorted(dists))}): not in [{role}]"
            )
    assert not uncovered, "add these to the role's extra in pyproject.toml:\n" + "\n".join(
        uncovered
    )


def test_every_role_installs_what_it_needs_unimported():
    missing = {role: sorted(needs - closure(role)) for role, needs in UNIMPORTED.items()}
    assert not any(missing.values()), missing


def test_the_proxy_and_the_sdk_install_no_torch():
    assert not closure("serve") & HEAVY, sorted(closure("serve") & HEAVY)
    assert not closure("") & {"fastapi", "pydantic", "sqlalchemy", *HEAVY}


def test_the_roles_nest_and_the_command_line_names_real_extras():
    roles = {*ROLES.values(), *COMMAND_EXTRAS.values(), *OPTIONAL_EXTRAS.values()} - {""}
    assert roles <= set(extras()), roles - set(extras())
    for role in roles - {"all", "dev", "docs"}:
        assert closure(role) <= closure("all"), role
    assert closure("all") | closure("docs") <= closure("dev")
    assert closure("serve") <= closure("engine") <= closure("train")
    assert not any("sglang" in spec for spec in extras()["all"] + extras()["dev"])


def missing_extra_run(blocked: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``proxrl ARGS`` in a subprocess where importing ``blocked`` fails as if not installed."""
    code = (
        f"import sys; sys.modules[{blocked!r}] = None; sys.argv = ['proxrl', *{list(args)!r}]; "
        "from server.cli import main; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("blocked", "args", "extra"),
    [
        ("torch", ["engine", "--model", "no-such-model"], "engine"),
        ("torch", ["model", "init", "no-such-dir"], "engine"),
        ("pydantic_settings", ["serve"], "serve"),
        ("yaml", ["train"], "train"),  # the trainer's config reads YAML
    ],
)
def test_the_command_line_names_the_missing_extra(blocked, args, extra):
    out = missing_extra_run(blocked, *args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        f"proxrl {args[0]}: {blocked} is not installed: pip install 'proxrl[{extra}]'"
    )


def test_importing_the_command_line_without_pydantic_does_nothing():
    code = "import sys; sys.modules['pydantic'] = None; import server.cli; print('imported')"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "imported\n", "")


@pytest.mark.parametrize(
    ("command", "runs"), [("serve", "server.main.serve"), ("train", "trainer.cli.main")]
)
def test_a_module_missing_while_a_command_runs_is_not_called_an_extra(monkeypatch, command, runs):
    """Once imported, the command's work is its own: a ModuleNotFoundError from it (a bug, or a
    package gone mid-run) propagates as it is, not as 'pip install proxrl[...]', exit 2."""
    from server.cli import main

    def fails(*args: object) -> None:
        raise ModuleNotFoundError("No module named 'late'", name="late")

    monkeypatch.setattr(runs, fails)
    with pytest.raises(ModuleNotFoundError, match="late"):
        main([command, "--model", "m"] if command == "serve" else [command])
