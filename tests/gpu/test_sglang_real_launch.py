"""``proxrl serve --engine sglang`` with a real SGLang (skipped without CUDA or SGLang): it
starts, learns the context and tensor-parallel size, and records what SGLang sampled."""

from __future__ import annotations

import importlib.util

import httpx
import pytest
from openai import OpenAI

from tests.support import ProxyProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs SGLang"),
]


def test_serve_launches_sglang_and_records_its_tokens(tiny_model_dir, tmp_path):
    flags = (
        "--engine", "sglang", "--sglang-start-timeout-s", "600",
        "--sglang-args", "--mem-fraction-static 0.2 --disable-cuda-graph",
    )  # fmt: skip
    proxy = ProxyProcess(tiny_model_dir, tmp_path / "serve", *flags)
    try:
        proxy.wait_ready(timeout=660)  # SGLang loads, then the proxy starts
        (engine,) = httpx.get(f"{proxy.url}/admin/engines", headers=proxy.admin).json()
        assert engine["healthy"] and engine["tp_size"] == 1 and engine["context_length"] > 0
        session = proxy.session()
        client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        for stream in (False, True):
            reply = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "Tell me about numbers."}],
                max_tokens=16,
                stream=stream,
            )
            if stream:
                list(reply)
        turns = proxy.get_session(session["session_id"])["turns"]
        assert len(turns) == 2
        for turn in turns:
            assert turn["completion_ids"] and turn["finish_reason"] in ("stop", "length")
            assert len(turn["logprobs"]) == len(turn["completion_ids"])
            assert set(turn["versions"]) == {0}
    finally:
        proxy.stop()
