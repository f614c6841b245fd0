"""An engine started with --incremental-streaming-output and an admin key."""

from __future__ import annotations

import httpx
import pytest

from tests.support import EngineProcess, parse_sse

ADMIN_KEY = "engine-admin-secret"


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    flags = ("--incremental-streaming-output", "--admin-api-key", ADMIN_KEY)
    with EngineProcess(tiny_model_dir, logs, *flags) as process:
        yield process


def stream(engine, body: dict) -> list[dict]:
    response = httpx.post(f"{engine.url}/generate", json={**body, "stream": True}, timeout=60)
    assert response.status_code == 200
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_incremental_chunks_are_deltas(engine):
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 5},
        "return_logprob": True,
    }
    chunks = stream(engine, body)
    whole = httpx.post(f"{engine.url}/generate", json=body, timeout=60).json()
    ids = [i for chunk in chunks for i in chunk["output_ids"]]
    assert ids == whole["output_ids"]
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"]
    logprobs = [e for chunk in chunks for e in chunk["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in logprobs] == ids
    for chunk in chunks:
        assert chunk["meta_info"]["output_token_logprobs_length"] == len(chunk["output_ids"])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert chunks[-1]["meta_info"]["completion_tokens"] == 40
    assert httpx.get(f"{engine.url}/server_info").json()["incremental_streaming_output"] is True


def test_stop_string_is_never_streamed(engine):
    base = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 40, "temperature": 0}}
    text = httpx.post(f"{engine.url}/generate", json=base, timeout=60).json()["text"]
    stop = text[10:13]
    body = {**base, "sampling_params": {**base["sampling_params"], "stop": [stop]}}
    chunks = stream(engine, body)
    streamed = "".join(chunk["text"] for chunk in chunks)
    assert streamed == text[: text.find(stop)]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_batch_stream_chunks_carry_an_index(engine):
    chunks = stream(
        engine,
        {
            "input_ids": [[1, 2], [3, 4]],
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        },
    )
    assert {chunk["index"] for chunk in chunks} == {0, 1}
    for index in (0, 1):
        ids = [i for c in chunks if c["index"] == index for i in c["output_ids"]]
        assert len(ids) == 5


def test_admin_key_guards_control_endpoints_only(engine):
    control = [
        ("/pause_generation", {"mode": "in_place"}),
        ("/continue_generation", {}),
        ("/abort_request", {"abort_all": True}),
        ("/update_weight_version", {"new_version": "x"}),
        ("/flush_cache", None),
    ]
    for path, body in control:
        refused = httpx.post(f"{engine.url}{path}", json=body)
        assert refused.status_code == 401, path
        wrong = httpx.post(
            f"{engine.url}{path}", json=body, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401, path
    allowed = httpx.post(
        f"{engine.url}/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert allowed.status_code == 200
    out = httpx.post(
        f"{engine.url}/generate",
        json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
        timeout=30,
    )
    assert out.status_code == 200
    assert httpx.get(f"{engine.url}/model_info").status_code == 200
