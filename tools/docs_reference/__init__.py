"""The reference pages of the documentation site (``docs/reference/``), generated from the code
so that they cannot drift from it: ``make docs`` writes them, and a unit test
(``tests/unit/test_docs_reference.py``) fails while a committed page differs from what the code
makes now.

Each page is made by one module from the objects it documents (parsers, settings classes,
dataclasses, the error table, the metric registry, the app's OpenAPI document), never from a
copy; the output is deterministic (definition order, no time, no path or value of this
machine). Nothing here starts a server or touches the network.

    python -m tools.docs_reference           # write the pages
    python -m tools.docs_reference --check   # exit 1 naming the pages that are stale
"""

from __future__ import annotations

from pathlib import Path

from tools.docs_reference import cli, config, environment, errors, metrics, rest_api
from tools.docs_reference.markdown import ROOT

REFERENCE = ROOT / "docs" / "reference"


def files() -> dict[str, str]:
    """Every generated file of ``docs/reference/``, by name, with its text."""
    document = rest_api.document()
    return {
        "cli.md": cli.page(),
        "environment.md": environment.page(),
        "config.md": config.page(),
        "metrics.md": metrics.page(),
        "errors.md": errors.page(document),
        "rest-api.md": rest_api.render(document),
        "openapi.json": rest_api.openapi_json(document),
    }


def stale(made: dict[str, str], folder: Path = REFERENCE) -> list[str]:
    """The names in ``made`` whose file in ``folder`` is missing or differs."""
    return [
        name
        for name, text in made.items()
        if not (folder / name).is_file() or (folder / name).read_text() != text
    ]
