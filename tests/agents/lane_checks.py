"""What every agent test asserts of its run and of the store, and the figures it prints."""

from __future__ import annotations

import json

from tests.agents.agent_programs import Agent, AgentRun

# How each surface carries a tool's result back to the model.
TOOL_RESULT_MARKERS = ('"role": "tool"', '"type": "tool_result"', '"type": "function_call_output"')


def carries_tool_result(messages: list) -> bool:
    text = json.dumps(messages)
    return any(marker in text for marker in TOOL_RESULT_MARKERS)


def calls_tool(turn: dict, name: str) -> bool:
    """Whether the turn's answer called the tool ``name`` (any surface's response shape)."""
    return f'"name": "{name}"' in json.dumps(turn["response"])


def check_agent_run(agent: Agent, run: AgentRun, session: dict) -> dict:
    """Assert the lane's contract for one agent run and return its figures."""
    assert run.returncode == 0, f"{agent.name} exited {run.returncode}:\n{run.stderr[-3000:]}"
    turns = session["turns"]
    assert turns, f"{agent.name} made no request that was recorded"

    # A tool round trip: a turn calls the shell tool, and a later request carries its result.
    calls = [i for i, turn in enumerate(turns) if calls_tool(turn, agent.shell_tool)]
    assert calls, f"no turn called {agent.shell_tool}: {[t['response'] for t in turns]}"
    assert any(carries_tool_result(t["messages"]) for t in turns[calls[0] + 1 :]), (
        "no request after the tool call carried its result"
    )

    # Every answered request recorded, with the usage the agent was told equal to what is stored
    # (summed, for an agent that tells only its run's total).
    stored = [(len(t["prompt_ids"]), len(t["completion_ids"])) for t in turns]
    if agent.reports_total_usage:
        stored = [(sum(p for p, _ in stored), sum(c for _, c in stored))]
    assert agent.usages(run) == stored

    # One row per conversation and no breaks.
    assert session["row_count"] == session["conversations"], session
    assert session["breaks"] == 0, session
    return {
        "agent": agent.name,
        "requests": len(turns),
        "finish_reasons": [t["finish_reason"] for t in turns],
        "turns_recorded": session["turn_count"],
        "rows": session["row_count"],
        "conversations": session["conversations"],
        "breaks": session["breaks"],
        "wall_s": round(run.wall_s, 1),
    }
