"""Claude Code, Anthropic's CLI agent on the Messages API, runs a shell command through proxrl."""

from __future__ import annotations

import json

import pytest

from tests.agents.agent_programs import CLAUDE_CODE
from tests.agents.lane_checks import check_agent_run

# The first agent test of a session warms the model up (minutes on two cores) unless it is cached.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_claude_code_runs_a_tool_round_trip_and_every_turn_is_recorded(agent_lane):
    session, run = agent_lane.run_warm(CLAUDE_CODE)
    stored = agent_lane.session(session["session_id"])
    figures = check_agent_run(CLAUDE_CODE, run, stored)

    # Its JSON tells the run's total usage (checked above) and how many requests it made.
    result = json.loads(run.stdout)
    assert (result["subtype"], result["num_turns"]) == ("success", figures["requests"]), result
    # Its first request: its system prompt, the task, then its environment as a system message
    # inside the request's messages (where the chat template renders it, not refused).
    assert [m["role"] for m in stored["turns"][0]["messages"]] == ["system", "user", "system"]
    print({"warm_up": agent_lane.warm_up[CLAUDE_CODE.name], **figures})
