"""The dashboard's and the step endpoint's pure parts: bucket widths, the trainer's liveness,
step cleaning and reward spread, token rows, the transcript, login targets, search fields."""

from __future__ import annotations

import math
import statistics
from datetime import UTC, datetime, timedelta

import pytest

from server.dashboard.access import safe_next
from server.dashboard.pages import session_filters, shown, token_colour
from server.dashboard.tokens import PROMPT_TURN, token_rows
from server.dashboard.transcript import transcript
from server.dashboard.views import TARGET_BUCKETS, bucket_width, trainer_active, trainer_status
from server.rl.schemas import RowOut, TurnOut
from server.rl.steps import clean_value, reward_spread, session_reward
from server.store.stats import StepSpan
from server.store.tables import TrainerStep
from tests.support import turn_out

NOW = datetime(2026, 1, 31, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("span", "width"),
    [(0, 1), (100, 1), (120, 1), (121, 2), (3600, 30), (86400, 900), (30 * 86400, 21600)],
)
def test_bucket_width_is_the_smallest_nice_width_that_fits(span, width):
    assert bucket_width(span) == width
    assert span / width <= TARGET_BUCKETS


def test_bucket_width_beyond_the_nice_widths_counts_whole_days():
    width = bucket_width(400 * 86400)
    assert width % 86400 == 0 and 400 * 86400 / width <= TARGET_BUCKETS


def span(count: int, first_ago_s: float, last_ago_s: float) -> StepSpan:
    return StepSpan(
        count, NOW - timedelta(seconds=first_ago_s), NOW - timedelta(seconds=last_ago_s)
    )


def test_trainer_is_active_within_three_step_intervals_or_five_minutes():
    assert trainer_active(None, NOW) is False
    assert trainer_active(span(1, 10, 10), NOW) is True
    assert trainer_active(span(1, 400, 400), NOW) is False
    # slow steps (one per 10 min): idle only after 30 min
    assert trainer_active(span(4, 1800 + 1200, 1200), NOW) is True
    assert trainer_active(span(4, 1800 + 2000, 2000), NOW) is False


def test_the_trainer_status_says_stopped_at_once_and_quiet_before_the_timeout():
    stepped = TrainerStep(step=3, version=3, metrics={"reward_mean": 0.5})
    stopped = TrainerStep(step=3, version=3, metrics={"reward_mean": 0.5, "stopped_at": 1.0})
    assert trainer_status(None, None, NOW) == ("not started", None)
    # steps every 2 s, the last 1 s ago: training
    assert trainer_status(span(10, 19, 1), stepped, NOW) == ("training", None)
    # the trainer said it stopped (a clean stop): stopped at once, not 5 minutes later
    assert trainer_status(span(10, 19, 1), stopped, NOW) == ("stopped", None)
    # no word for 40 s (20 intervals) after an unclean stop: still within the timeout, but quiet
    last = NOW - timedelta(seconds=40)
    assert trainer_status(span(10, 58, 40), stepped, NOW) == ("training", last)
    # within 30 s of the last step it is not called quiet, however fast the steps were
    assert trainer_status(span(10, 29, 20), stepped, NOW) == ("training", None)
    # past the timeout: idle, and still since when
    last = NOW - timedelta(seconds=400)
    assert trainer_status(span(10, 418, 400), stepped, NOW) == ("idle", last)


def test_clean_value_turns_non_finite_numbers_into_null():
    assert clean_value(math.nan) is None and clean_value(-math.inf) is None
    assert clean_value([1, math.inf, "x", None, 2.5]) == [1, None, "x", None, 2.5]
    assert clean_value("nan") == "nan" and clean_value(3) == 3


def test_reward_spread_matches_the_population_statistics():
    values = [0.1, 0.4, 0.4, 0.9, -0.3]
    spread = reward_spread(values)
    assert spread["reward_std"] == pytest.approx(statistics.pstdev(values), abs=1e-12)
    assert (spread["reward_min"], spread["reward_max"]) == (-0.3, 0.9)
    assert reward_spread([]) == {}
    assert reward_spread([2.0])["reward_std"] == 0.0


def test_session_reward_prefers_the_session_target_then_sums_turns():
    assert session_reward({"session": 1.0, "chatcmpl-a": 5.0}) == 1.0
    assert session_reward({"chatcmpl-a": 0.5, "chatcmpl-b": 0.25}) == 0.75
    assert session_reward({}) is None


def row(ids: list[int], mask: list[int], turns: list[tuple[int, int]]) -> RowOut:
    return RowOut(
        row_index=0,
        input_ids=ids,
        loss_mask=mask,
        logprobs=[-0.5 if m else 0.0 for m in mask],
        versions=[3 if m else -1 for m in mask],
        turns=[{"completion_id": f"c{i}", "start": a, "end": b} for i, (a, b) in enumerate(turns)],
    )


def test_token_rows_mark_each_token_with_its_turn_and_text():
    rows = [row([10, 11, 12, 13, 14, 15], [0, 1, 1, 0, 1, 0], [(1, 3), (4, 5)])]
    decoded: list[int] = []

    def text(token_id: int) -> str:
        decoded.append(token_id)
        return f"<{token_id}>"

    (viewed,) = token_rows(rows, text)
    assert viewed.ids == [10, 11, 12, 13, 14, 15]
    assert viewed.turn == [PROMPT_TURN, 0, 0, PROMPT_TURN, 1, PROMPT_TURN]
    assert viewed.pieces == ["<10>", "<11>", "<12>", "<13>", "<14>", "<15>"]
    assert viewed.loss_mask == rows[0].loss_mask and viewed.versions == rows[0].versions
    rows = [row([7, 7, 7], [0, 1, 1], [(1, 3)])]
    decoded.clear()
    token_rows(rows, text)
    assert decoded == [7]  # each distinct id decoded once


def turn(index: int, messages: list | None, reply: str, request: str | None = None) -> TurnOut:
    response = {"role": "assistant", "content": reply, "tool_calls": None}
    return turn_out(
        index,
        surface="chat",
        model="tiny",
        messages=messages,
        response=response,
        request_id=request,
        created_at=NOW,
    )


def test_transcript_shows_only_what_each_turn_adds():
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    rewritten = [{"role": "user", "content": "start over"}]
    entries = transcript(
        [turn(0, first, "hello"), turn(1, second, "yes"), turn(2, rewritten, "ok")]
    )
    assert [e.messages for e in entries] == [first, [{"role": "user", "content": "?"}], rewritten]
    assert [e.hidden for e in entries] == [0, 3, 0]


def test_transcript_groups_the_choices_of_one_request():
    messages = [{"role": "user", "content": "hi"}]
    entries = transcript([turn(0, messages, "a", "r"), turn(1, messages, "b", "r")])
    assert entries[0].messages == messages and not entries[0].same_request
    assert entries[1].same_request and entries[1].messages == []


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/admin/sessions?status=open", "/admin/sessions?status=open"),
        ("/admin/runs/run-1", "/admin/runs/run-1"),
        ("//evil.example/admin", "/admin/runs"),
        ("https://evil.example/admin", "/admin/runs"),
        ("/admin\\@evil.example", "/admin/runs"),
        ("/rl/runs", "/admin/runs"),
        (None, "/admin/runs"),
    ],
)
def test_login_goes_back_only_to_dashboard_paths(target, expected):
    assert safe_next(target) == expected


def test_search_fields_read_leniently_and_name_what_is_wrong():
    filters, problems = session_filters(
        {
            "run_id": " run-1 ",
            "status": "",
            "reward_min": "0.5",
            "reward_max": "high",
            "created_after": "2026-01-31T12:00",
            "created_before": "2026-01-31T13:00:00+01:00",
        }
    )
    assert filters["run_id"] == "run-1" and "status" not in filters
    assert filters["reward_min"] == 0.5 and "reward_max" not in filters
    assert filters["created_after"] == NOW  # no zone: UTC
    assert filters["created_before"] == NOW
    assert problems == ["reward_max: cannot read 'high'"]
    assert session_filters({"status": "lost"})[1] == ["status: cannot read 'lost'"]


def test_token_colours_run_from_red_to_green_and_grey_for_prompt():
    assert token_colour(0.0, 0).startswith("background:#e9e9ee")
    assert token_colour(0.0, 1) == "background:hsl(120,70%,82%)"
    assert token_colour(-50.0, 1) == "background:hsl(0,70%,82%)"
    assert token_colour(math.log(0.5), 1) == "background:hsl(60,70%,82%)"
    assert shown("\n") == "↵\n" and shown("") == "∅" and shown(" a") == " a"
