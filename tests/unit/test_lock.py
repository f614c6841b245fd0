"""The environment is the lock's, and the lock is within pyproject.toml's bounds.

``requirements/lock.txt`` (``make lock``, ``make upgrade``) pins every package for Linux x86_64,
CPython 3.11; ``make venv`` installs exactly it. Tests run against anything else test something
CI does not: this fails, naming the packages, until ``make venv`` has synced the env.
``PROXRL_LOCK`` names another lock (``make upgrade`` tests its scratch lock so).
"""

from __future__ import annotations

import importlib.metadata
import os
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from requirements import lockfile
from requirements.lockfile import normalized
from tests.support import ROOT

LOCK = Path(os.environ.get("PROXRL_LOCK", ROOT / "requirements" / "lock.txt"))


def pins() -> dict[str, str]:
    return lockfile.pins(LOCK.read_text())


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_the_env_is_the_lock():
    differ = []
    for name, pinned in sorted(pins().items()):
        version = installed(name)
        if version is None or Version(version).public != Version(pinned).public:
            differ.append(f"{name}: locked {pinned}, installed {version or 'nothing'}")
    assert not differ, f"this env is not {LOCK}'s (run `make venv`):\n" + "\n".join(differ)


def test_the_lock_is_within_the_bounds_and_cpu_only():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {k: v for k, v in project["optional-dependencies"].items() if k != "sglang"}
    locked = pins()
    outside = []
    for spec in [*project["dependencies"], *(s for specs in extras.values() for s in specs)]:
        requirement = Requirement(spec)
        name = normalized(requirement.name)
        if name != "proxrl" and not requirement.specifier.contains(locked[name]):
            outside.append(f"{spec}: the lock has {locked.get(name)}")
    assert not outside, outside
    cuda = sorted(n for n in locked if n.startswith(("nvidia-", "cuda-")) or n == "triton")
    assert not cuda, f"the lock holds CUDA packages: {cuda}"
    assert "+" not in locked["torch"], "the lock pins torch without a local label"


def test_the_header_names_the_locks_own_torch(tmp_path):
    compiled = tmp_path / "lock.txt"
    compiled.write_text(
        "proxrl @ file:///somewhere/proxrl\n"
        "torch==2.14.1+cpu          # via proxrl\n"
        "numpy==2.4.0               # via torch\n"
    )
    lockfile.finish(compiled)
    once = compiled.read_text()
    lockfile.finish(compiled)  # finishing twice changes nothing
    assert compiled.read_text() == once
    assert once == lockfile.header("2.14.1") + (
        "torch==2.14.1          # via proxrl\nnumpy==2.4.0               # via torch\n"
    )
    assert "`torch==2.14.1`" in once
    assert lockfile.header(pins()["torch"]) in LOCK.read_text(), "run `make lock`"
