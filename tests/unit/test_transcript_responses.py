"""The dashboard's transcript shows Responses API turns in chat's form: input items as
messages, the Response's output items as one assistant reply (reasoning, text, calls)."""

from __future__ import annotations

from server.dashboard.transcript import transcript
from server.rl.schemas import TurnOut
from tests.support import turn_out


def _turn(index: int, items: list, output: list) -> TurnOut:
    response = {"id": f"resp_{index}", "object": "response", "output": output}
    rid = f"resp_{index}"
    return turn_out(
        index,
        surface="responses",
        model="gpt-5.6-luna",
        messages=items,
        response=response,
        completion_id=rid,
        request_id=rid,
    )


def test_the_transcript_shows_responses_turns_in_chat_form():
    asked = [
        {"type": "message", "role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
    ]
    thought = {
        "type": "reasoning",
        "id": "rs",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "add"}],
    }
    call = {
        "type": "function_call",
        "id": "fc",
        "call_id": "c",
        "name": "calc",
        "arguments": '{"e": "2+2"}',
        "status": "completed",
    }
    result = {"type": "function_call_output", "call_id": "c", "output": "4"}
    said = {
        "type": "message",
        "id": "m",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "It is 4.", "annotations": []}],
    }
    # The agent resends its history: the call, its output; then a chained turn adds a question.
    entries = transcript(
        [
            _turn(0, asked, [call]),
            _turn(1, [*asked, call, result], [said]),
            _turn(2, [{"role": "user", "content": "Sure?"}], [thought, said, call]),
        ]
    )
    assert entries[0].messages == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
    ]
    assert entries[0].reply == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "calc", "arguments": '{"e": "2+2"}'}],
    }
    assert entries[1].messages == [{"role": "tool", "content": "4"}]
    assert entries[1].hidden == 3
    assert entries[1].reply == {"role": "assistant", "content": "It is 4."}
    assert entries[2].messages == [{"role": "user", "content": "Sure?"}]
    assert entries[2].reply == {
        "role": "assistant",
        "content": "(thinking) add\nIt is 4.",
        "tool_calls": [{"name": "calc", "arguments": '{"e": "2+2"}'}],
    }


def test_custom_tool_calls_show_as_tool_calls_with_their_raw_input():
    """Codex's apply_patch is a custom tool: its call carries raw text (``input``)."""
    asked = [{"role": "user", "content": "Fix it."}]
    call = {
        "type": "custom_tool_call",
        "id": "ctc",
        "call_id": "c",
        "name": "apply_patch",
        "input": "*** Begin Patch\n*** End Patch",
    }
    result = {"type": "custom_tool_call_output", "call_id": "c", "output": "Done!"}
    entries = transcript([_turn(0, asked, [call]), _turn(1, [*asked, call, result], [])])
    shown_call = {"name": "apply_patch", "arguments": "*** Begin Patch\n*** End Patch"}
    assert entries[0].reply == {"role": "assistant", "content": "", "tool_calls": [shown_call]}
    assert entries[1].messages == [{"role": "tool", "content": "Done!"}]
    assert entries[1].hidden == 2
