"""A first look through the real proxy: the openai SDK in, tokens in the store."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.support import ProxyProcess


@pytest.fixture(scope="module")
def proxy(tiny_model_dir, tmp_path_factory):
    with ProxyProcess(tiny_model_dir, tmp_path_factory.mktemp("proxy")) as process:
        yield process


def test_chat_turn_lands_in_the_store(proxy):
    session = proxy.session(task_id="smoke")
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8
    )
    stored = proxy.get_session(session["session_id"])
    (turn,) = stored["turns"]
    assert turn["completion_id"] == reply.id
    assert len(turn["completion_ids"]) == reply.usage.completion_tokens
    assert len(turn["logprobs"]) == len(turn["versions"]) == len(turn["completion_ids"])
