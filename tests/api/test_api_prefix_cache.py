"""The engine's prefix cache on the path agents take: through the proxy, an agent's next step
(its history, the model's answer and a new user turn, rendered by the chat template) reuses the
KV of the step before, as the engine's counters show."""

from __future__ import annotations

from tests.api.api_support import Api
from tests.api.conftest import ThreadedEngine

SYSTEM = "You are a coding agent. " + "Read the file, run the tests, fix what fails. " * 30


def test_an_agents_next_step_reuses_the_kv_of_the_step_before(api: Api, engine: ThreadedEngine):
    session = api.new_session(task_id="prefix-cache")
    client = api.openai(session["api_key"])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Start."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    before = engine.service.prefix_cache_info()
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "The tests still fail; go on."},
    ]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    after = engine.service.prefix_cache_info()
    assert first.usage is not None
    reused = after["reused_tokens"] - before["reused_tokens"]
    print(f"first prompt {first.usage.prompt_tokens} tokens; the next step reused {reused}")
    assert after["hits"] == before["hits"] + 1
    # At least the whole first prompt (the system text is hundreds of tokens) came from the cache.
    assert reused >= first.usage.prompt_tokens
