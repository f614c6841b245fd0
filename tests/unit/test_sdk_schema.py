"""The SDK's response types say what the server sends: each TypedDict of ``client_sdk._types``
against its component of the server's OpenAPI document, field by field, both ways: the names,
which are required, and the types (str, int, float, bool, list and dict of what, nullable, or
another of the table's types). The SDK is a separate package and keeps its own copies; this test
is what keeps them from drifting."""

from __future__ import annotations

import types
from typing import (
    Any,
    NotRequired,
    Required,
    TypedDict,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

import pytest

from client_sdk import _types
from server.main import create_app
from server.settings import ServerSettings

# Each SDK type -> the component schema of what the server sends. A new type goes here.
SCHEMAS = {
    "Run": "RunOut",
    "RunCreated": "RunCreated",
    "SessionCreated": "SessionCreated",
    "SessionDetail": "SessionOut",
    "Turn": "TurnOut",
    "Row": "RowOut",
    "RewardResult": "RewardOut",
    "SessionEnded": "SessionEnded",
    "EvalFigures": "EvalFigures",
    "RunEval": "RunEval",
    "RunTraining": "RunTraining",
    "Promotion": "PromotionOut",
    "PromotionCandidate": "PromotionCandidate",
}
# Types the SDK builds from another answer: the schema, and each field's name there.
SAME = "policy_version", "sessions", "totals"
PROJECTIONS = {"RunMetrics": ("RunOut", {"run_id": "id", **{name: name for name in SAME}})}
# What the client's calls get back: method, path -> the SDK type (a list: [type]).
ROUTES = {
    ("post", "/rl/runs"): "RunCreated",
    ("get", "/rl/runs"): ["Run"],
    ("get", "/rl/runs/{run_id}"): "Run",
    ("patch", "/rl/runs/{run_id}"): "Run",
    ("post", "/rl/sessions"): "SessionCreated",
    ("get", "/rl/sessions/{session_id}"): "SessionDetail",
    ("post", "/rl/sessions/{session_id}/reward"): "RewardResult",
    ("post", "/rl/sessions/{session_id}/end"): "SessionEnded",
}
JSON_TYPES = {"string": "str", "integer": "int", "number": "float", "boolean": "bool"}
PYTHON_TYPES = {str: "str", int: "int", float: "float", bool: "bool"}
REF = "#/components/schemas/"


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = tmp_path_factory.mktemp("model")  # the document needs no model: nothing starts
    return create_app(ServerSettings(model=str(model), admin_key="k" * 32)).openapi()


@pytest.fixture(scope="module")
def components(document: dict[str, Any]) -> dict[str, Any]:
    return document["components"]["schemas"]


def sdk_types() -> dict[str, type]:
    return {
        name: value
        for name, value in vars(_types).items()
        if is_typeddict(value) and value.__module__ == _types.__name__
    }


def schema_type(schema: dict[str, Any]) -> str:
    """A component schema's type, coarsely: ``list[int]``, ``dict[any]``, ``str | None``, or
    ``ref:TurnOut`` for another component."""
    if "$ref" in schema:
        return "ref:" + schema["$ref"].removeprefix(REF)
    if "anyOf" in schema:
        options = [option for option in schema["anyOf"] if option != {"type": "null"}]
        assert len(options) == 1, f"no coarse type for {schema}"
        inner = schema_type(options[0])
        return f"{inner} | None" if len(options) < len(schema["anyOf"]) else inner
    kind = schema.get("type")
    if kind is None:
        return "any"
    if kind == "array":
        return f"list[{schema_type(schema.get('items', {}))}]"
    if kind == "object":
        values = schema.get("additionalProperties", True)
        return f"dict[{'any' if values is True else schema_type(values)}]"
    return JSON_TYPES[kind]


def sdk_type(hint: Any) -> str:
    """A TypedDict field's type, written as :func:`schema_type` writes the server's."""
    if hint is Any:
        return "any"
    if is_typeddict(hint):
        return "ref:" + SCHEMAS[hint.__name__]
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        options = [arg for arg in args if arg is not type(None)]
        assert len(options) == 1, f"no coarse type for {hint}"
        inner = sdk_type(options[0])
        return f"{inner} | None" if len(options) < len(args) else inner
    if origin is list:
        return f"list[{sdk_type(args[0])}]"
    if origin is dict:
        return f"dict[{sdk_type(args[1])}]"
    return PYTHON_TYPES[hint]


def required_keys(sdk: type) -> set[str]:
    """The keys a TypedDict requires, read from its annotations (with postponed annotations,
    Python 3.11's ``__required_keys__`` misses ``NotRequired``)."""
    total = sdk.__total__  # type: ignore[attr-defined]
    hints = get_type_hints(sdk, include_extras=True)
    return {
        name
        for name, hint in hints.items()
        if get_origin(hint) is Required or (total and get_origin(hint) is not NotRequired)
    }


def differences(sdk: type, schema: dict[str, Any], names: dict[str, str] | None = None) -> list:
    """How the TypedDict ``sdk`` differs from the component ``schema``, both ways. With
    ``names`` (SDK field -> schema field), only those fields of the schema are expected."""
    hints = get_type_hints(sdk)
    names = names or {field: field for field in schema["properties"]}
    sent = {ours: schema["properties"][theirs] for ours, theirs in names.items()}
    required = {ours for ours, theirs in names.items() if theirs in schema.get("required", [])}
    found = [f"the server sends {field!r}; the SDK lacks it" for field in sent.keys() - hints]
    for field in hints.keys() - sent.keys():
        found.append(f"the SDK expects {field!r}; the server does not send it")
    for field in sent.keys() & hints.keys():
        theirs, ours = schema_type(sent[field]), sdk_type(hints[field])
        if theirs != ours:
            found.append(f"{field!r} is {theirs} on the server, {ours} in the SDK")
        theirs, ours = (
            "required" if field in keys else "optional" for keys in (required, required_keys(sdk))
        )
        if theirs != ours:
            found.append(f"{field!r} is {theirs} on the server, {ours} in the SDK")
    return found


def test_every_sdk_type_is_in_the_table():
    assert set(sdk_types()) == SCHEMAS.keys() | PROJECTIONS.keys()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_sdk_type_matches_the_server_schema(components, name):
    assert differences(sdk_types()[name], components[SCHEMAS[name]]) == []


@pytest.mark.parametrize("name", sorted(PROJECTIONS))
def test_sdk_projection_matches_the_server_schema(components, name):
    schema, names = PROJECTIONS[name]
    assert differences(sdk_types()[name], components[schema], names) == []


@pytest.mark.parametrize(("method", "path"), sorted(ROUTES))
def test_client_calls_get_the_schema_of_their_sdk_type(document, method, path):
    expected = ROUTES[(method, path)]
    responses = document["paths"][path][method]["responses"]
    (answer,) = (response for status, response in responses.items() if status.startswith("2"))
    got = schema_type(answer["content"]["application/json"]["schema"])
    if isinstance(expected, list):
        assert got == f"list[ref:{SCHEMAS[expected[0]]}]"
    else:
        assert got == f"ref:{SCHEMAS[expected]}"


class DriftedRun(TypedDict):
    """Run as it was (no model_path, weights_path), and drifted further."""

    id: str
    name: str
    model: str
    config: dict[str, Any]
    policy_version: NotRequired[int]
    is_default: bool
    created_at: str
    sessions: dict[str, int]
    totals: dict[str, float]
    eval: _types.RunEval
    promotion: _types.Promotion | None
    training: _types.RunTraining
    rollbacks: list[list[int]]
    note: str


def test_drift_is_found_both_ways(components):
    assert sorted(differences(DriftedRun, components["RunOut"])) == [
        "'policy_version' is required on the server, optional in the SDK",
        "'totals' is dict[int] on the server, dict[float] in the SDK",
        "the SDK expects 'note'; the server does not send it",
        "the server sends 'model_path'; the SDK lacks it",
        "the server sends 'weights_path'; the SDK lacks it",
    ]
