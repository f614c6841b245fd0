"""The proxy against its own OpenAPI document: schemathesis over every operation.

``schemathesis run`` (all four phases: the document's examples, coverage of each bound's edges,
random fuzzing in positive and negative mode, and the stateful phase, which chains operations
through the ids one answer gives the next: a run's id, a session's id, a claim's id) drives a
real ``proxrl serve`` with the admin key. It fails on any 5xx, any status an operation does not
document, and any answer whose content type, headers or body do not match the document, and on
schema-invalid input that is not refused with a 4xx.

Checks left out, and why:
- ``positive_data_acceptance``: most schema-valid requests name ids that do not exist (a 404 is
  the right answer), and many valid bodies are refused for what they would train (top_p < 1).
- ``use_after_free``, ``ensure_resource_availability``: the one DELETE (a stored Responses API
  response) deletes what no generated call can create; tests/api/test_api_responses.py holds
  it: a deleted response is gone for GET and for chaining, its turn stays.
- ``ignored_auth``, ``object_level_authorization``: the document declares no security scheme
  (keys are checked per route, as OpenAI does); tests/integration/test_auth_matrix.py holds
  every route against every kind of caller.
- ``missing_required_header``, ``unsupported_method``, ``allow_header_conformance``: FastAPI's
  own answers (405 without our error shape) for methods no route has; not ours to shape.

Generation sizes: proxy_fuzz_hooks.py caps max_tokens and a run's admission wait, and keeps
generation bodies to what the proxy trains on (see there); ``MAX_EXAMPLES`` bounds the cases per
operation and phase, ``CONFIG`` the stateful phase's scenarios and their length.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support import ProxyProcess

MAX_EXAMPLES = 6
SEED = 14
# No cache between runs: each run is the same run (the seed's), and leaves nothing in the tree.
CONFIG = """
[cache]
enabled = false

[phases.stateful]
max-steps = 20

[phases.stateful.generation]
max-examples = 60
"""
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
]

# In `make test`, not `make test-slow`: the API is fuzzed on every change (~3 minutes).
pytestmark = pytest.mark.timeout(420)


def schemathesis_run(proxy: ProxyProcess, workdir: Path) -> tuple[int, str]:
    import subprocess

    model = httpx.get(f"{proxy.url}/v1/models", headers=proxy.admin).json()["data"][0]["id"]
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [
        str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config),
        "run", f"{proxy.url}/openapi.json",
        "--header", f"Authorization: Bearer {proxy.ADMIN_KEY}",
        "--checks", ",".join(CHECKS),
        "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1",
        "--request-timeout", "30", "--no-shrink", "--output-truncate", "true",
        # Generation's own health, not a check of the answers: with the integer X-Proxrl-Version
        # header beside Anthropic's, hypothesis discards most header sets it draws for the
        # session-path Messages route at this seed, and stops that operation as "filtered".
        "--suppress-health-check", "filter_too_much",
        "--report", "json", "--report-json-path", str(workdir / "report.json"),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PROXRL_FUZZ_MODEL": model,
        "PYTHONPATH": str(Path(__file__).parent),
        "SCHEMATHESIS_HOOKS": "proxy_fuzz_hooks",
        "NO_COLOR": "1",
    }
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=280, check=False
    )
    return done.returncode, done.stdout + done.stderr


def test_every_operation_keeps_to_its_documented_statuses_and_shapes(tiny_model_dir, tmp_path):
    with ProxyProcess(tiny_model_dir, tmp_path / "proxy") as proxy:
        started = time.monotonic()
        returncode, output = schemathesis_run(proxy, tmp_path)
        seconds = time.monotonic() - started
        engines = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin).json()
    report = tmp_path / "report.json"
    summary = json.loads(report.read_text()) if report.exists() else {}
    print(output[-3000:])
    print(f"schemathesis: {seconds:.0f} s, {summary.get('test_cases')}, ", end="")
    print(f"{sum(e['served_tokens'] for e in engines)} tokens sampled")
    assert returncode == 0, output[-12000:]
