"""The OpenAPI document says what the server sends: every error in our shape, request-validation
errors with the status ``errors._validation_error`` gives them, and each input bounded."""

from __future__ import annotations

import pytest

from server.errors import documented
from server.main import create_app
from server.proxy.anthropic_schemas import is_anthropic_path
from server.settings import ServerSettings

REF = "#/components/schemas/ErrorBody"
ANTHROPIC_REF = "#/components/schemas/AnthropicErrorBody"


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = tmp_path_factory.mktemp("model")  # the document needs no model: nothing starts
    return create_app(ServerSettings(model=str(model), admin_key="k" * 32)).openapi()


def operations(document: dict):
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield path, method, operation


def test_every_error_is_documented_in_its_apis_shape(document):
    """OpenAI's error shape everywhere, Anthropic's on the Messages routes."""
    assert "HTTPValidationError" not in str(document)
    for path, method, operation in operations(document):
        for status, response in operation["responses"].items():
            if status.startswith("2") or path == "/health":  # its 503 is a status, not an error
                continue
            schema = response["content"]["application/json"]["schema"]
            expected = ANTHROPIC_REF if is_anthropic_path(path) else REF
            assert schema == {"$ref": expected}, (method, path, status)


def test_validation_errors_are_documented_with_the_status_they_get(document):
    for path, method, operation in operations(document):
        if not (operation.get("parameters") or operation.get("requestBody")):
            continue
        openai = path.startswith(("/v1/", "/sessions/"))
        assert ("400" if openai else "422") in operation["responses"], (method, path)
        if openai:
            assert "422" not in operation["responses"], (method, path)


def test_every_integer_and_string_input_is_bounded(document):
    for path, method, operation in operations(document):
        for parameter in operation.get("parameters", []):
            for schema in parameter["schema"].get("anyOf", [parameter["schema"]]):
                if schema.get("type") == "integer":
                    assert "maximum" in schema, (method, path, parameter["name"])
                if schema.get("type") == "string" and "format" not in schema:
                    assert "maxLength" in schema or "enum" in schema, (
                        method,
                        path,
                        parameter["name"],
                    )


def test_health_documents_its_503(document):
    responses = document["paths"]["/health"]["get"]["responses"]
    assert responses["503"]["content"]["application/json"]["schema"]["$ref"].endswith("/Health")


def test_a_refusal_with_retry_after_documents_the_header():
    assert "Retry-After" in documented(429)[429]["headers"]
