"""``/generate`` and the info endpoints of a real engine process, checked against the reference."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support import EngineProcess, logprob_error, parse_sse, stream_events

LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    with EngineProcess(tiny_model_dir, tmp_path_factory.mktemp("logs")) as process:
        yield process


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def generate(engine, body: dict, status: int = 200):
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=60)
    assert response.status_code == status, response.text
    return response.json()


def generate_together(engine, bodies: list[dict]) -> list[dict]:
    """Send every body at once; the outputs in order."""

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:
            calls = [client.post(f"{engine.url}/generate", json=body) for body in bodies]
            return [reply.json() for reply in await asyncio.gather(*calls)]

    return asyncio.run(run_all())


def sampled(prompt: list[int], max_new_tokens: int, temperature: float = 1.0) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
    return {"input_ids": prompt, "sampling_params": params, "return_logprob": True}


def test_response_shape(engine):
    out = generate(
        engine,
        {
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
            "rid": "shape-1",
            "return_logprob": True,
        },
    )
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4
    assert meta["completion_tokens"] == 6 == len(out["output_ids"])
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    assert meta["input_token_logprobs"] == []
    assert meta["output_token_logprobs_length"] == 6
    assert [entry[1] for entry in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(entry[2] is None for entry in meta["output_token_logprobs"])
    assert meta["e2e_latency"] > 0
    assert isinstance(meta["response_sent_to_client_ts"], float)


def test_logprobs_equal_a_teacher_forced_forward_pass(engine, model):
    """Concurrent requests at several temperatures: every logprob within 1e-4 of the reference."""
    prompts = [[3, 14, 15, 92, 65], list(range(40, 70)), [7], list(range(100, 112))]
    temperatures = [1.0, 0.6, 1.5, 0.0]
    lengths = [40, 25, 60, 12]

    bodies = [sampled(p, n, t) for p, t, n in zip(prompts, temperatures, lengths, strict=True)]
    outputs = generate_together(engine, bodies)
    for prompt, temperature, out in zip(prompts, temperatures, outputs, strict=True):
        assert logprob_error(model, prompt, out, temperature) < LOGPROB_TOLERANCE


def test_greedy_matches_hf_generate(engine, model, tokenizer):
    import torch

    prompt = tokenizer.encode("What is 12 + 30?", add_special_tokens=False)
    out = generate(
        engine,
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 20, "temperature": 0}},
    )
    with torch.inference_mode():
        reference = model.generate(
            torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
    produced = out["output_ids"]
    assert produced == reference[: len(produced)]


def test_input_logprobs_and_top_logprobs(engine, model, tokenizer):
    import torch

    prompt = [11, 22, 33, 44, 55, 66]
    out = generate(
        engine,
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 3,
            "return_text_in_logprobs": True,
        },
    )
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt
    assert entries[0][0] is None
    with torch.inference_mode():
        log_probs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), -1)
    for i in range(1, len(prompt)):
        assert abs(entries[i][0] - log_probs[i - 1, prompt[i]].item()) < LOGPROB_TOLERANCE
        assert entries[i][2] == tokenizer.decode([prompt[i]])
    assert meta["input_top_logprobs"][0] is None
    assert len(meta["output_top_logprobs"]) == 3
    for position in meta["output_top_logprobs"]:
        values = [entry[0] for entry in position]
        assert len(position) == 3 and values == sorted(values, reverse=True)
    start = generate(
        engine,
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 4,
        },
    )
    assert [e[1] for e in start["meta_info"]["input_token_logprobs"]] == prompt[4:]


def test_text_prompt_and_prompt_token_ids(engine, tokenizer):
    out = generate(
        engine,
        {
            "text": "Hello there",
            "sampling_params": {"max_new_tokens": 2},
            "return_prompt_token_ids": True,
        },
    )
    assert out["prompt_token_ids"] == tokenizer.encode("Hello there", add_special_tokens=False)


def test_seeded_sampling_is_reproducible(engine):
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 30, "sampling_seed": 42, "ignore_eos": True},
    }
    assert generate(engine, body)["output_ids"] == generate(engine, body)["output_ids"]


def test_stop_token_ids_and_eos(engine, tokenizer):
    # Learn what greedy decoding produces, then stop on its third token.
    body = {"input_ids": [9, 8, 7], "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    ids = generate(engine, {**body, "sampling_params": {**body["sampling_params"]}})["output_ids"]
    stop_at = ids[2]
    first = ids.index(stop_at)
    params = {**body["sampling_params"], "stop_token_ids": [stop_at]}
    out = generate(engine, {**body, "sampling_params": params})
    assert out["output_ids"] == ids[: first + 1]  # the stop token stays in output_ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}
    assert out["text"] == tokenizer.decode(ids[:first])  # ...but not in the text
    kept = generate(engine, {**body, "sampling_params": {**params, "no_stop_trim": True}})
    assert kept["text"] == tokenizer.decode(ids[: first + 1])


def test_stop_strings(engine, tokenizer):
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 30, "temperature": 0}}
    full = generate(engine, body)
    text = full["text"]
    stop = text[5:8]
    assert len(stop) == 3
    out = generate(engine, {**body, "sampling_params": {**body["sampling_params"], "stop": stop}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    assert tokenizer.decode(out["output_ids"]).find(stop) >= 0  # output_ids are not trimmed


def test_max_new_tokens_zero_is_prefill_only(engine):
    out = generate(engine, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}})
    assert out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_cumulative_stream(engine):
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
        "return_logprob": True,
        "rid": "stream-1",
    }
    response = httpx.post(f"{engine.url}/generate", json={**body, "stream": True}, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    lengths = [len(chunk["output_ids"]) for chunk in chunks]
    # One chunk per token (stream_interval 1), except where the text ended in half a UTF-8
    # character: that chunk is held back and the next one carries it.
    assert lengths == sorted(set(lengths)) and lengths[-1] == 8
    for chunk in chunks:
        n = len(chunk["output_ids"])
        assert len(chunk["meta_info"]["output_token_logprobs"]) == n
        assert chunk["output_ids"] == chunks[-1]["output_ids"][:n]
        assert chunk["meta_info"]["id"] == "stream-1"
        assert not chunk["text"].endswith("\ufffd") or chunk is chunks[-1]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    assert "weight_versions" in chunks[-1]["meta_info"]


def test_batch_and_n(engine):
    batch = generate(
        engine,
        {
            "input_ids": [[1, 2], [3, 4, 5]],
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "rid": "batch",
        },
    )
    assert [o["meta_info"]["id"] for o in batch] == ["batch_0", "batch_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in batch] == [2, 3]
    samples = generate(
        engine,
        {
            "input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": 3, "n": 3},
            "rid": "many",
        },
    )
    assert len(samples) == 3
    assert len({o["meta_info"]["id"] for o in samples}) == 3  # fresh rids, as in SGLang
    assert all(o["meta_info"]["id"] != "many" for o in samples)


def test_continuous_batching_runs_requests_together(engine):
    """16 streams: every one has tokens before the first one finishes, and the engine's load
    shows them running together."""
    seen: dict[str, int] = {}
    first_finish: dict[str, dict[str, int]] = {}
    peak = {"running": 0}

    def on_chunk(chunk):
        rid = chunk["meta_info"]["id"]
        seen[rid] = len(chunk["output_ids"])
        if chunk["meta_info"]["finish_reason"] is not None and not first_finish:
            first_finish["snapshot"] = dict(seen)

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as client:

            async def watch_load():
                while len(first_finish) == 0:
                    loads = (await client.get(f"{engine.url}/v1/loads")).json()["loads"][0]
                    peak["running"] = max(peak["running"], loads["num_running_reqs"])
                    await asyncio.sleep(0.05)

            streams = [
                stream_events(
                    client,
                    f"{engine.url}/generate",
                    {
                        "input_ids": [i + 1, i + 2, i + 3],
                        "sampling_params": {"max_new_tokens": 60 + 5 * i, "ignore_eos": True},
                        "rid": f"cb-{i}",
                    },
                    on_chunk,
                )
                for i in range(16)
            ]
            await asyncio.gather(watch_load(), *streams)

    asyncio.run(run_all())
    snapshot = first_finish["snapshot"]
    assert len(snapshot) == 16, snapshot
    assert all(count >= 1 for count in snapshot.values())
    assert peak["running"] >= 8


def test_long_requests_finishing_at_different_times(engine, model):
    """Past the KV buffers' first size, requests that finish early hand their slot to the last
    running one; the others carry on with exact logprobs (a regression: this once killed the
    scheduler thread)."""
    prompts = [list(range(1, 301)), list(range(2, 290)), list(range(3, 320))]
    lengths = [5, 40, 20]

    outputs = generate_together(
        engine, [sampled(p, n) for p, n in zip(prompts, lengths, strict=True)]
    )
    for prompt, n, out in zip(prompts, lengths, outputs, strict=True):
        assert len(out["output_ids"]) == n
        assert logprob_error(model, prompt, out) < LOGPROB_TOLERANCE
    assert httpx.get(f"{engine.url}/health", timeout=30).status_code == 200


def test_abort_request_by_prefix(engine):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            progress: dict[str, int] = {}

            def on_chunk(chunk):
                progress[chunk["meta_info"]["id"]] = len(chunk["output_ids"])

            body = {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
            }
            streams = [
                asyncio.create_task(
                    stream_events(client, f"{engine.url}/generate", {**body, "rid": rid}, on_chunk)
                )
                for rid in ("job-a-1", "job-a-2", "job-b-1")
            ]
            while len(progress) < 3:
                await asyncio.sleep(0.05)
            reply = await client.post(f"{engine.url}/abort_request", json={"rid": "job-a"})
            assert reply.status_code == 200 and reply.content == b""
            a1, a2 = await asyncio.gather(*streams[:2])
            await client.post(f"{engine.url}/abort_request", json={"abort_all": True})
            b1 = await streams[2]
            return a1, a2, b1

    a1, a2, b1 = asyncio.run(run())
    for events in (a1, a2, b1):
        last = events[-2]
        assert events[-1] == "[DONE]"
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(last["output_ids"]) < 1500


def test_abort_returns_partial_logprobs_consistently(engine, model):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            request = asyncio.create_task(
                client.post(
                    f"{engine.url}/generate",
                    json={
                        "input_ids": [5, 4, 3],
                        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
                        "return_logprob": True,
                        "rid": "partial",
                    },
                )
            )
            await asyncio.sleep(0.5)
            await client.post(f"{engine.url}/abort_request", json={"rid": "partial"})
            return (await request).json()

    out = asyncio.run(run())
    meta = out["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    n = len(out["output_ids"])
    assert 0 < n < 1500 and meta["completion_tokens"] == n
    assert logprob_error(model, [5, 4, 3], out) < LOGPROB_TOLERANCE


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = httpx.get(f"{engine.url}/v1/loads").json()["loads"][0]
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"still busy after {timeout}s: {load}")


def test_requests_of_clients_that_went_away_are_aborted(engine):
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}/generate", json=body, timeout=httpx.Timeout(1.0, connect=5))
    wait_until_idle(engine)
    with httpx.stream(
        "POST", f"{engine.url}/generate", json={**body, "stream": True}, timeout=30
    ) as response:
        next(response.iter_lines())  # one chunk, then hang up
    wait_until_idle(engine)


def test_duplicate_rid_is_refused(engine):
    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {
                "input_ids": [1],
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
                "rid": "twin",
            }
            first = asyncio.create_task(client.post(f"{engine.url}/generate", json=body))
            await asyncio.sleep(0.3)
            second = await client.post(f"{engine.url}/generate", json=body)
            await client.post(f"{engine.url}/abort_request", json={"rid": "twin"})
            return second, await first

    second, first = asyncio.run(run())
    assert second.status_code == 400
    assert second.json() == {"error": {"message": "Duplicate request ID detected: twin"}}
    assert first.json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must"),
        ({"input_ids": [1] * 2100}, "longer than the model's context length"),
        (
            {"input_ids": [1] * 2000, "sampling_params": {"max_new_tokens": 100}},
            "exceeds the model",
        ),
        ({"input_ids": [99999]}, "out of the vocabulary range"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p must be in"),
        ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "not supported"),
        ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ],
)
def test_values_the_engine_refuses(engine, body, error):
    out = generate(engine, body, status=400)
    assert error in out["error"]["message"]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "unknown field `bogus`"),
        ({"input_ids": "abc"}, "`input_ids`"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
        ({"input_ids": [1], "stream": "yes"}, "`stream`"),
    ],
)
def test_schema_errors_have_a_string_error(engine, body, error):
    out = generate(engine, body, status=400)
    assert isinstance(out["error"], str) and error in out["error"]


def test_malformed_json_and_the_engine_keeps_serving(engine):
    response = httpx.post(
        f"{engine.url}/generate",
        content=b'{"input_ids": [1, 2',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and isinstance(response.json()["error"], str)
    bad_pause = httpx.post(f"{engine.url}/pause_generation", json={"mode": "sideways"})
    assert bad_pause.status_code == 400
    assert bad_pause.json()["object"] == "error" and bad_pause.json()["code"] == 400
    assert generate(engine, {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})


def test_unknown_top_level_keys_are_ignored(engine):
    out = generate(
        engine, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "whatever": 3}
    )
    assert len(out["output_ids"]) == 1


def test_info_endpoints(engine, tiny_model_dir):
    info = httpx.get(f"{engine.url}/model_info").json()
    assert info["model_path"] == str(tiny_model_dir)
    assert info["weight_version"] == "default"
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    assert httpx.get(f"{engine.url}/get_model_info").json()["model_path"] == str(tiny_model_dir)
    server = httpx.get(f"{engine.url}/server_info").json()
    assert server["context_length"] == 2048
    assert server["incremental_streaming_output"] is False
    assert "last_gen_throughput" in server["internal_states"][0]
    assert httpx.get(f"{engine.url}/get_server_info").status_code == 200
    models = httpx.get(f"{engine.url}/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == str(tiny_model_dir)
    assert models["data"][0]["max_model_len"] == 2048
    missing = httpx.get(f"{engine.url}/v1/models/nope")
    assert missing.status_code == 404 and "error" in missing.json()
    loads = httpx.get(f"{engine.url}/v1/loads").json()["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens"} <= set(loads)


def test_health_generates(engine):
    started = time.perf_counter()
    assert httpx.get(f"{engine.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{engine.url}/health_generate", timeout=30).status_code == 200
    assert httpx.get(f"{engine.url}/ready").status_code == 200
    assert time.perf_counter() - started < 25
