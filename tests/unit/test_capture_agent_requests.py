"""tools/capture_agent_requests.py, started as an agent would meet it (a process on 127.0.0.1,
one per surface) and spoken to with the real SDKs: each request is logged with its keys
redacted, the scripted tool call answers the first request that offers its tool, every other
answers the text, and the SDKs' stream helpers parse the streams into the same answer."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

TOOL = Path(__file__).parents[2] / "tools" / "capture_agent_requests.py"
SECRET = "sk-capture-secret-123"
INPUT = {"command": "echo hi"}
TEXT = "Captured."


class Captured:
    def __init__(self, process: subprocess.Popen, url: str, log: Path) -> None:
        self.process, self.url, self.log = process, url, log

    def entries(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def capture(request, tmp_path: Path) -> Iterator[Captured]:
    log = tmp_path / "requests.jsonl"
    command = [sys.executable, str(TOOL), "--surface", request.param, "--port", "0"]
    command += ["--log", str(log), "--text", TEXT, "--tool", "Bash"]
    command += ["--tool-input", json.dumps(INPUT), "--timeout", "60"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # "capturing <surface> at http://127.0.0.1:<port>"
        assert line.startswith(f"capturing {request.param} at http://127.0.0.1:"), line
        yield Captured(process, line.split(" at ")[1].strip(), log)
    finally:
        process.terminate()
        process.wait(timeout=10)


def assert_logged(entry: dict, path: str, body: dict) -> None:
    """The request as sent, its key header (x-api-key or authorization, as the SDK sends it)
    redacted and the key nowhere."""
    assert (entry["method"], entry["path"]) == ("POST", path)
    keys = {k: v for k, v in entry["headers"].items() if k in ("x-api-key", "authorization")}
    assert keys and set(keys.values()) == {"<redacted>"}, entry["headers"]
    assert SECRET not in json.dumps(entry)
    assert entry["body"]["tools"] == body["tools"] and entry["body"]["stream"] is True


@pytest.mark.parametrize("capture", ["messages"], indirect=True)
def test_messages_are_logged_and_streamed_as_anthropics_sdk_reads_them(capture: Captured):
    client = anthropic.Anthropic(api_key=SECRET, base_url=capture.url, max_retries=0, timeout=10)
    tools = [{"name": "Bash", "input_schema": {"type": "object"}}]
    request = {
        "model": "claude-x",
        "max_tokens": 64,
        "tools": tools,
        "messages": [{"role": "user", "content": "hi"}],
    }
    finals = []
    for _ in range(2):  # the scripted call, then the text
        with client.messages.stream(**request) as stream:  # type: ignore[arg-type]
            finals.append(stream.get_final_message())
    called, answered = finals
    assert [(b.type, b.name, b.input) for b in called.content if b.type == "tool_use"] == [
        ("tool_use", "Bash", INPUT)
    ]
    assert called.stop_reason == "tool_use"
    assert [b.text for b in answered.content if b.type == "text"] == [TEXT]
    first, second = capture.entries()
    assert_logged(first, "/v1/messages", {**request, "stream": True})
    assert second["n"] == 2


@pytest.mark.parametrize("capture", ["responses"], indirect=True)
def test_responses_are_logged_and_streamed_as_openais_sdk_reads_them(capture: Captured):
    client = openai.OpenAI(api_key=SECRET, base_url=f"{capture.url}/v1", max_retries=0, timeout=10)
    tools = [{"type": "function", "name": "Bash", "parameters": {"type": "object"}}]
    request = {"model": "gpt-x", "input": "hi", "tools": tools}
    finals = []
    for _ in range(2):
        with client.responses.stream(**request) as stream:  # type: ignore[call-overload]
            finals.append(stream.get_final_response())
    called, answered = finals
    calls = [item for item in called.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("Bash", INPUT)]
    assert answered.output_text == TEXT
    first, _ = capture.entries()
    assert_logged(first, "/v1/responses", {**request, "stream": True})


@pytest.mark.parametrize("capture", ["chat"], indirect=True)
def test_chat_completions_are_logged_and_streamed_as_openais_sdk_reads_them(capture: Captured):
    client = openai.OpenAI(api_key=SECRET, base_url=f"{capture.url}/v1", max_retries=0, timeout=10)
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]
    request = {"model": "gpt-x", "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    finals = []
    for _ in range(2):
        with client.chat.completions.stream(**request) as stream:  # type: ignore[arg-type]
            finals.append(stream.get_final_completion())
    called, answered = finals
    calls = called.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("Bash", INPUT)]
    assert answered.choices[0].message.content == TEXT
    plain = client.chat.completions.create(**request)  # type: ignore[call-overload]
    assert plain.choices[0].message.content == TEXT  # not streamed: one JSON body
    first, _, third = capture.entries()
    assert_logged(first, "/v1/chat/completions", {**request, "stream": True})
    assert "stream" not in third["body"]
