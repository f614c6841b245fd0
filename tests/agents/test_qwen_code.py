"""Qwen Code, an open-source CLI agent on Chat Completions, runs a shell command through proxrl."""

from __future__ import annotations

import pytest

from tests.agents.agent_programs import QWEN_CODE
from tests.agents.lane_checks import check_agent_run

# The first agent test of a session warms the model up (minutes on two cores) unless it is cached.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def test_qwen_code_runs_a_tool_round_trip_and_every_turn_is_recorded(agent_lane):
    session, run = agent_lane.run_warm(QWEN_CODE)
    figures = check_agent_run(QWEN_CODE, run, agent_lane.session(session["session_id"]))
    print({"warm_up": agent_lane.warm_up[QWEN_CODE.name], **figures})
