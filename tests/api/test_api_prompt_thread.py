"""Where a prompt is made: on the event loop for a small body, on a prompt thread for a large one.

Handing a prompt to a prompt thread and back costs more CPU than rendering, tokenizing and
splicing a prompt of a few kilobytes, so a body of at most ``INLINE_PROMPT_BYTES`` has its
prompt made on the loop (``server.proxy.prompts.off_loop``); a larger one still goes to a
prompt thread, so that it holds no other request (tests/api/test_api_large_prompts.py). The
work is observed, not replaced: ``spliced`` is wrapped and still does the work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from server.proxy import plan, prompts
from tests.api.api_support import Api

ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
PATHS = ["/v1/chat/completions", "/v1/responses", "/v1/messages"]


def on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def made(monkeypatch) -> list[tuple[bool, float]]:
    """(made on the loop?, seconds) of every prompt made while the test runs."""
    seen: list[tuple[bool, float]] = []
    original: Callable[..., Any] = plan.spliced

    def observed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seen.append((on_loop(), time.perf_counter() - started))

    monkeypatch.setattr(plan, "spliced", observed)
    return seen


def send(api: Api, path: str, text: str) -> None:
    """One request of ``text`` on ``path``, answered or refused once its prompt was made."""
    session = api.new_session()
    messages = [{"role": "user", "content": text}]
    if path == "/v1/responses":
        body: dict = {"model": "tiny", "input": messages, "max_output_tokens": 2}
    else:
        body = {"model": "tiny", "messages": messages, "max_tokens": 2}
    reply = api.call("POST", path, key=session["api_key"], json=body, headers=ANTHROPIC_HEADERS)
    # the tiny model's context is 2,048 tokens: a long prompt is made, then refused as too long
    assert reply.status_code == 200 or "tokens; the model's context" in reply.text, reply.text


@pytest.mark.parametrize("path", PATHS)
def test_a_small_body_has_its_prompt_made_on_the_loop(api: Api, made, path: str):
    send(api, path, "hello there " * 10)
    assert [where for where, _ in made] == [True]


@pytest.mark.parametrize("path", PATHS)
def test_a_body_past_the_bound_has_its_prompt_made_on_a_thread(api: Api, made, path: str):
    send(api, path, "x" * (prompts.INLINE_PROMPT_BYTES + 1))
    assert [where for where, _ in made] == [False]


def test_the_largest_inline_prompt_holds_the_loop_briefly(api: Api, made):
    """A body just under the bound: its prompt is made on the loop in a few milliseconds. Here
    it took 1.3 ms (at a 16 KiB bound, 5-17 ms); the bound below is generous for a shared 2-core
    machine, and far under the seconds a 28 MB prompt held the loop before prompt threads."""
    text = "the quick brown fox jumps over the lazy dog " * (
        (prompts.INLINE_PROMPT_BYTES - 200) // 44
    )
    send(api, "/v1/chat/completions", text)
    ((where, seconds),) = made
    assert where, "made on a prompt thread"
    assert seconds < 0.05, f"held the loop {1000 * seconds:.1f} ms"


def test_a_small_body_that_continues_a_stored_chain_has_its_prompt_made_on_a_thread(api: Api, made):
    """``previous_response_id`` brings the stored chain into the prompt: a body of 100 bytes
    can stand for a conversation of 10,000 responses, so its size says nothing of the prompt's
    (before: such a prompt was made on the loop, holding every other request)."""
    session = api.new_session()
    body = {"model": "tiny", "input": "hello", "max_output_tokens": 2}
    first = api.call("POST", "/v1/responses", key=session["api_key"], json=body)
    assert first.status_code == 200, first.text
    body |= {"previous_response_id": first.json()["id"]}
    second = api.call("POST", "/v1/responses", key=session["api_key"], json=body)
    assert second.status_code == 200, second.text
    assert [where for where, _ in made] == [True, False]
