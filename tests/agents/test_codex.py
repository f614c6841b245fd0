"""The Codex CLI, OpenAI's agent on the Responses API, runs a shell command through proxrl on
its default path: a model name it knows, its free-form ``apply_patch`` tool offered, its hosted
tools left out."""

from __future__ import annotations

import re

import pytest

from tests.agents.agent_programs import CODEX
from tests.agents.lane_checks import check_agent_run

# The first agent test of a session warms the model up (minutes on two cores) unless it is cached.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# What exec_command sends back for ls in the lane's folder: a chunk id and a wall time that vary.
RESULT = (
    r"Chunk ID: [0-9a-f]{6}\nWall time: \d+\.\d{4} seconds\nProcess exited with code 0\n"
    r"Original token count: 3\nOutput:\nnotes\.txt\n"
)


def test_codex_runs_a_tool_round_trip_and_every_turn_is_recorded(agent_lane):
    session, run = agent_lane.run_warm(CODEX)
    stored = agent_lane.session(session["session_id"])
    figures = check_agent_run(CODEX, run, stored)

    # What --json prints is the task's sum of what each answer told.
    usages = CODEX.usages(run)
    assert CODEX.task_usage(run) == tuple(map(sum, zip(*usages, strict=True)))

    # The result Codex sent back is shaped as the warm-up's (agent_programs.codex_result).
    (result,) = [m for m in stored["turns"][1]["messages"] if m["type"] == "function_call_output"]
    assert re.fullmatch(RESULT, result["output"]), result

    # The default path: the known model name; apply_patch sent as a custom (free-form) tool and
    # offered to the model as a function; the hosted tools left out, and recorded, every turn.
    for turn in stored["turns"]:
        assert turn["model"] == CODEX.MODEL
        sent = {tool["type"]: tool.get("name") for tool in turn["response"]["tools"]}
        assert sent["custom"] == "apply_patch", sent
        assert "apply_patch" in [tool["function"]["name"] for tool in turn["tools"]]
        assert turn["sampling"]["omitted_tools"] == ["tool_search", "web_search"]
    print({"warm_up": agent_lane.warm_up[CODEX.name], **figures, "usages": usages})
