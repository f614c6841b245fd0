"""``reference/rest-api.md`` and ``reference/openapi.json``: every path and method the proxy serves.

Read from the app's OpenAPI document, ``create_app(settings).openapi()``: building the app starts
nothing (resources are made in its lifespan, which does not run) and the document depends on no
setting, so a settings object made without reading the environment stands in. Knows nothing of
what a route does beyond its document.
"""

from __future__ import annotations

import json
from typing import Any

from server.main import create_app
from server.settings import ServerSettings
from tools.docs_reference import markdown as md

SOURCES = ["the app's OpenAPI document (`create_app` in server/main.py)"]
_REF = "#/components/schemas/"
_MEDIA = {
    "application/json": "JSON",
    "text/event-stream": "SSE stream",
    "application/x-ndjson": "JSON Lines",
    "application/vnd.apache.parquet": "Parquet",
}


def document() -> dict[str, Any]:
    """The OpenAPI document of an app built from default settings (no environment read)."""
    return create_app(ServerSettings.model_construct(model="MODEL")).openapi()


def openapi_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def schema_name(schema: dict[str, Any] | None) -> str | None:
    """``Name`` for a reference, ``list of Name``, ``Name or null``; None for an open schema."""
    if not schema:
        return None
    if "$ref" in schema:
        return str(schema["$ref"]).removeprefix(_REF)
    if "anyOf" in schema:
        names = [schema_name(s) or "any" for s in schema["anyOf"]]
        return " or ".join(names)
    if schema.get("type") == "array":
        return f"list of {schema_name(schema.get('items')) or 'any'}"
    return schema.get("type")


def _content(content: dict[str, Any]) -> str:
    said = []
    for media, entry in content.items():
        name = schema_name(entry.get("schema"))
        said.append(md.code(name) if name else _MEDIA.get(media, md.code(media.split(";")[0])))
    return " or ".join(dict.fromkeys(said))


def _parameters(operation: dict[str, Any]) -> str:
    said = []
    for parameter in operation.get("parameters", []):
        required = "" if parameter.get("required") else ", optional"
        said.append(f"{md.code(parameter['name'])} ({parameter['in']}{required})")
    return "<br>".join(said) or "—"


def _responses(operation: dict[str, Any]) -> str:
    """Statuses grouped by what they answer: ``201: `RunCreated`; 400, 401: `ErrorBody```."""
    by_answer: dict[str, list[str]] = {}
    for status, response in sorted(operation["responses"].items()):
        answer = _content(response.get("content", {})) or "no body"
        by_answer.setdefault(answer, []).append(status)
    return "<br>".join(f"{', '.join(statuses)}: {answer}" for answer, statuses in by_answer.items())


def render(doc: dict[str, Any]) -> str:
    info = doc["info"]
    intro = (
        f"{md.text(info.get('summary', ''))}: the HTTP API of `proxrl serve`, OpenAPI "
        f"{doc['openapi']}. The whole document is [openapi.json](openapi.json) (a running "
        "server serves it at `/openapi.json`, browsable at `/docs`); its schemas, named below, "
        "say every field. Errors: see [Errors](errors.md)."
    )
    groups: dict[str, list[list[str]]] = {}
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            tag = (operation.get("tags") or ["other"])[0]
            body = operation.get("requestBody")
            groups.setdefault(tag, []).append(
                [
                    f"{md.code(method.upper())} {md.code(path)}",
                    md.text(operation.get("summary", "")),
                    _parameters(operation),
                    (_content(body["content"]) + ("" if body.get("required") else ", optional"))
                    if body
                    else "—",
                    _responses(operation),
                ]
            )
    blocks = [md.head("REST API", SOURCES, intro)]
    for tag, rows in groups.items():
        blocks += [
            f"## {tag}",
            md.table(["Route", "Summary", "Parameters", "Body", "Responses"], rows),
        ]
    schemas = sorted(doc.get("components", {}).get("schemas", {}))
    blocks += ["## Schemas", ", ".join(md.code(name) for name in schemas) + "."]
    return md.join(blocks)
