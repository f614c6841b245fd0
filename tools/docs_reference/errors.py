"""``reference/errors.md``: every error the server answers with, and its shape on each API surface.

From ``server/errors.py``: its tree of exceptions, its one table (``RENDERING``: status, type,
default code, Retry-After), the meaning its docstring gives each class (the page refuses to build
where the docstring's status is not the table's); the codes raisers give beyond the table, found
in the source; the bodies and stream events each surface's renderer makes of one example error;
and which routes each surface holds, from the app's OpenAPI document. Knows nothing of when an
error is raised.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server import errors
from server.errors import RENDERING, TYPE_OF_STATUS, ProxrlError, body_of
from server.proxy import answer
from server.proxy.anthropic import MessagesRenderer
from server.proxy.anthropic_schemas import anthropic_type, is_anthropic_path
from server.proxy.outputs import OpenAIRenderer
from server.proxy.responses_render import ResponsesRenderer
from tools.docs_reference import markdown as md

SOURCES = ["server/errors.py", "server/proxy/anthropic_schemas.py", "the surfaces' renderers"]
_TREE_LINE = re.compile(r"^[\s│├└─]*(\w+)\s+(\d{3})\b\s*(.*)$")


class DocstringDisagrees(AssertionError):
    """server/errors.py's drawn tree gives a class another status than its table."""


@dataclass(frozen=True)
class Kind:
    cls: type[ProxrlError]
    depth: int
    meaning: str


def kinds() -> list[Kind]:
    """Every class of the tree, depth first in definition order, with its docstring meaning."""
    drawn = {}
    for line in (errors.__doc__ or "").splitlines():
        found = _TREE_LINE.match(line)
        if found:
            drawn[found[1]] = (int(found[2]), found[3])

    def walk(cls: type[ProxrlError], depth: int) -> Iterator[Kind]:
        status, meaning = drawn.get(cls.__name__, (None, ""))
        if status is not None and status != errors.rendering_of(cls).status:
            raise DocstringDisagrees(
                f"server/errors.py's docstring gives {cls.__name__} {status}, its RENDERING "
                f"{errors.rendering_of(cls).status}"
            )
        yield Kind(cls, depth, meaning)
        for sub in cls.__subclasses__():
            if sub.__module__ == errors.__name__:
                yield from walk(sub, depth + 1)

    return list(walk(ProxrlError, 0))


def raised_codes(root: Path = md.ROOT) -> list[tuple[str, str, list[str]]]:
    """(class, code, files) for the raises of a class of the tree with a ``code="..."`` of their
    own."""
    names = {kind.cls.__name__ for kind in kinds()}
    found: dict[tuple[str, str], set[str]] = {}
    for path in sorted((root / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in names:
                continue
            for keyword in node.keywords:
                if keyword.arg == "code" and isinstance(keyword.value, ast.Constant):
                    key = (node.func.id, str(keyword.value.value))
                    found.setdefault(key, set()).add(path.relative_to(root).as_posix())
    return [(cls, code, sorted(files)) for (cls, code), files in sorted(found.items())]


def example() -> ProxrlError:
    """The error each surface's example shows."""
    return errors.SessionNotOpen("ended")


def stream_text(renderer: Any, error: ProxrlError) -> str:
    """What a stream of ``renderer``'s surface sends when it fails after its first event."""
    return answer.frame(renderer, renderer.error(error)) + answer.frame(
        renderer, renderer.closing()
    )


def _responses_renderer() -> ResponsesRenderer:
    renderer = ResponsesRenderer.__new__(ResponsesRenderer)  # only its event count is read
    renderer.sequence = 0
    return renderer


def surfaces(document: dict[str, Any]) -> dict[str, list[str]]:
    """The paths of the OpenAPI document by the error shape and validation status they get."""
    found: dict[str, list[str]] = {"anthropic": [], "openai": [], "rest": []}
    for path in document["paths"]:
        if is_anthropic_path(path):
            found["anthropic"].append(path)
        elif errors._is_openai_path(path):
            found["openai"].append(path)
        else:
            found["rest"].append(path)
    return found


def _json(value: Any) -> str:
    return "```json\n" + json.dumps(value, indent=2) + "\n```"


def _text(value: str) -> str:
    return "```text\n" + value.rstrip("\n") + "\n```"


def _paths(paths: list[str]) -> str:
    return ", ".join(md.code(p) for p in paths)


def render(
    found: list[Kind], codes: list[tuple[str, str, list[str]]], routes: dict[str, list[str]]
) -> str:
    intro = (
        "Every error is one exception of `server/errors.py`'s tree, rendered in one place: its "
        "table gives each class the HTTP status, `type` and default `code` the client gets, and "
        "whether a `Retry-After` header says when to try again. A raiser may give a more "
        "precise `code`. An unexpected exception is a 500 `server_error` whose message says "
        f"only {md.code(errors.INTERNAL_MESSAGE)} (the traceback goes to the log)."
    )
    rows = []
    for kind in found:
        rendering = RENDERING.get(kind.cls) or errors.rendering_of(kind.cls)
        indent = "&nbsp;&nbsp;" * kind.depth
        rows.append(
            [
                indent + md.code(kind.cls.__name__),
                str(rendering.status),
                md.code(rendering.type),
                md.code(rendering.code) if rendering.code else "—",
                f"{rendering.retry_after_s} s" if rendering.retry_after_s is not None else "—",
                md.code(anthropic_type(rendering.status)),
                md.text(kind.meaning),
            ]
        )
    error = example()
    openai_body = body_of(error)
    blocks = [
        md.head("Errors", SOURCES, intro),
        "## Error codes",
        md.table(
            [
                "Exception",
                "Status",
                "`type`",
                "`code`",
                "Retry-After",
                "Anthropic `type`",
                "Meaning",
            ],
            rows,
        ),
        "Codes raisers give beyond the table's:",
        md.table(
            ["Exception", "`code`", "Raised in"],
            [
                [md.code(c), md.code(code), ", ".join(md.code(f) for f in files)]
                for c, code, files in codes
            ],
        ),
        "Refusals the web framework makes itself (an unknown path: 404, a method the path does "
        "not take: 405, request validation: see below) come in the same shape, with the type "
        "of their status ("
        + ", ".join(f"{status}: {md.code(kind)}" for status, kind in sorted(TYPE_OF_STATUS.items()))
        + "; `invalid_request_error` for any other) and no `code`.",
        "## Shapes by API surface",
        f"The examples below are what each surface's renderer makes of one error "
        f"({md.code(type(error).__name__)}, {error.status}).",
        "### OpenAI-compatible routes",
        "Chat Completions, Completions, Responses and models: "
        + _paths(routes["openai"])
        + ". The body is OpenAI's; request validation is a 400 with the field in `param`.",
        _json(openai_body),
        "A Chat Completions or Completions stream that fails after it started (the status is "
        "already 200) ends with the same body as an event, then `[DONE]`:",
        _text(stream_text(OpenAIRenderer, error)),
        "A Responses stream ends with an `error` event:",
        _text(stream_text(_responses_renderer(), error)),
        "### Anthropic-compatible routes",
        _paths(routes["anthropic"])
        + ": Anthropic's shape. Its `type` is Anthropic's name for the status (column "
        '"Anthropic `type`" above); it has no `param` (the message names the field) and no '
        "`code`. Request validation is a 400.",
        _json(
            MessagesRenderer.error(error)[0]  # the same body before a stream starts
        ),
        "A stream that fails after it started ends with the same body as an `error` event:",
        _text(stream_text(MessagesRenderer, error)),
        "### RL REST, admin and dashboard routes",
        "Every other route (" + _paths(routes["rest"]) + ") answers OpenAI's body, as above; "
        "request validation there is a 422 (FastAPI's status) with the field in `param`:",
        _json(
            errors.error_body(
                "Input should be greater than 0 (at max_sessions)",
                "invalid_request_error",
                "max_sessions",
            )
        ),
    ]
    return md.join(blocks)


def page(document: dict[str, Any]) -> str:
    return render(kinds(), raised_codes(), surfaces(document))
