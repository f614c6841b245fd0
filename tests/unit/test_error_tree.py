"""The server's one error tree (``server.errors``): every class has one rendering in the table,
the tree drawn in the docstring is the real one, each class reaches the client in OpenAI's shape
(as a status and as a stream's error event) with a status the routes document, and the SDK
maps each status to its own exception."""

from __future__ import annotations

import inspect
import re

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import client_sdk
import server.main
from client_sdk._errors import error_from_response
from server import errors
from server.errors import RENDERING, ProxrlError
from server.proxy.streaming import api_error
from server.settings import ServerSettings


def tree_classes() -> set[type[ProxrlError]]:
    found, todo = {ProxrlError}, [ProxrlError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found


def test_every_class_of_the_tree_has_one_rendering_and_lives_in_server_errors():
    assert server.main  # the whole app is imported: any subclass made elsewhere is seen
    classes = tree_classes()
    assert set(RENDERING) == classes
    assert {kind.__module__ for kind in classes} == {"server.errors"}


def test_one_error_type_per_status():
    types: dict[int, set[str]] = {}
    for rendering in RENDERING.values():
        types.setdefault(rendering.status, set()).add(rendering.type)
    assert all(len(kinds) == 1 for kinds in types.values()), types
    assert {status: kinds.pop() for status, kinds in types.items()} == errors.TYPE_OF_STATUS


def drawn_tree() -> list[tuple[int, str, int]]:
    """(depth, class name, status) of each line of the module docstring's tree."""
    doc = errors.__doc__ or ""
    block = doc.split("The tree::", 1)[1].split("\n\n")[1]
    rows = []
    for line in block.splitlines():
        match = re.match(r"^[\s│├└─]*?(\w+)\s*(\d{3})\b", line)
        assert match, line
        rows.append((match.start(1), match.group(1), int(match.group(2))))
    root = rows[0][0]
    return [((column - root) // 4, name, status) for column, name, status in rows]


def test_the_docstring_draws_every_class_under_its_real_parent_with_its_status():
    rows = drawn_tree()
    assert sorted(name for _, name, _ in rows) == sorted(k.__name__ for k in RENDERING)
    by_name = {kind.__name__: kind for kind in RENDERING}
    parents: list[str] = []
    for depth, name, status in rows:
        parents[depth:] = [name]
        kind = by_name[name]
        assert RENDERING[kind].status == status, name
        if depth:
            assert kind.__bases__ == (by_name[parents[depth - 1]],), name


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = tmp_path_factory.mktemp("model")  # the document needs no model: nothing starts
    settings = ServerSettings(model=str(model), admin_key="k" * 32)
    return server.main.create_app(settings).openapi()


def test_every_status_of_the_table_is_documented_by_a_route(document):
    documented = {
        int(status)
        for methods in document["paths"].values()
        for operation in methods.values()
        for status in operation["responses"]
        if not status.startswith("2")
    }
    statuses = {r.status for kind, r in RENDERING.items() if kind is not ProxrlError}
    assert statuses <= documented  # the root's 500 is a bug, not an answer a route promises
    assert statuses | {500} <= set(errors.MEANINGS) | {500}


def example(kind: type[ProxrlError]) -> ProxrlError:
    """An instance of ``kind``, made with whatever its constructor asks for."""
    values = {"str": "x", "str | None": "x", "float": 0.5, "int": 3, "list[str]": ["s-1"]}
    arguments = [
        values[str(parameter.annotation)]
        for parameter in inspect.signature(kind.__init__).parameters.values()
        if parameter.name != "self" and parameter.default is inspect.Parameter.empty
    ]
    return kind(*arguments)


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    errors.install(app)

    @app.get("/raise/{name}")
    async def raise_it(name: str) -> None:
        raise example(next(k for k in RENDERING if k.__name__ == name))

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("kind", sorted(RENDERING, key=lambda k: k.__name__), ids=str)
def test_each_class_is_answered_in_openai_shape_as_the_table_says(client, kind):
    rendering = RENDERING[kind]
    exc = example(kind)
    response = client.get(f"/raise/{kind.__name__}")
    assert response.status_code == rendering.status
    body = response.json()
    assert body == {
        "error": {"message": exc.message, "type": rendering.type, "param": exc.param,
                  "code": rendering.code}
    }  # fmt: skip
    assert exc.message.startswith(rendering.lead) and exc.message.endswith(str(exc))
    if rendering.retry_after_s is None:
        assert "retry-after" not in response.headers
    else:
        assert int(response.headers["retry-after"]) >= 1
    assert api_error(exc) is exc  # a stream ends with the same error as its event


def test_a_raiser_may_name_its_own_code_and_retry_after():
    exc = errors.AuthenticationRequired("Missing API key.", code="invalid_api_key")
    assert (exc.status, exc.type, exc.code) == (401, "authentication_error", "invalid_api_key")
    assert errors.StalenessBound(7).headers == {"Retry-After": "7"}


def test_an_unexpected_error_is_a_500_that_shows_nothing(client):
    app = FastAPI()
    errors.install(app)

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError("secret internals")

    response = TestClient(app, raise_server_exceptions=False).get("/bug")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert "secret" not in response.text


SDK_CLASSES = {
    400: client_sdk.BadRequestError,
    401: client_sdk.AuthenticationError,
    403: client_sdk.PermissionDeniedError,
    404: client_sdk.NotFoundError,
    409: client_sdk.ConflictError,
    410: client_sdk.APIStatusError,  # no class of its own either
    413: client_sdk.APIStatusError,  # as the openai SDK: no class of its own
    422: client_sdk.UnprocessableEntityError,
    429: client_sdk.RateLimitError,
    500: client_sdk.InternalServerError,
    502: client_sdk.InternalServerError,
    503: client_sdk.InternalServerError,
}


@pytest.mark.parametrize("kind", sorted(RENDERING, key=lambda k: k.__name__), ids=str)
def test_the_sdk_raises_its_own_class_for_each_answer(kind):
    exc = example(kind)
    response = httpx.Response(
        exc.status,
        json=errors.body_of(exc),
        headers=exc.headers,
        request=httpx.Request("GET", "http://proxrl.test/"),
    )
    raised = error_from_response(response)
    assert type(raised) is SDK_CLASSES[exc.status]
    assert (raised.message, raised.type, raised.code) == (exc.message, exc.type, exc.code)
