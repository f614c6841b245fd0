"""The one text of the trained-share warning (server/common/trained_share.py), which the trainer's
log and the server's run view both give."""

from __future__ import annotations

from server.common.trained_share import share_warning, untrained_warning

MASKED = {"stale": 30, "off_temperature": 5, "behaviour": 12, "alternative": 1}
DROPPED = {"stale": 2, "no_trainable_tokens": 7}


def test_below_the_level_one_sentence_names_the_three_biggest_of_each_kind_biggest_first():
    warning = share_warning(0.6, 100, MASKED, DROPPED, 0.8)
    assert warning == (
        "only 60% of the 100 tokens the trainer's sessions sampled trained "
        "(min_trained_share 0.8); the biggest causes: 30 tokens masked as stale; "
        "12 tokens masked as behaviour; 5 tokens masked as off_temperature; "
        "7 sessions dropped as no_trainable_tokens; 2 sessions dropped as stale"
    )


def test_at_or_above_the_level_or_without_a_share_there_is_no_warning():
    assert share_warning(0.8, 100, MASKED, DROPPED, 0.8) is None
    assert share_warning(0.95, 100, MASKED, DROPPED, 0.8) is None
    assert share_warning(None, 100, MASKED, DROPPED, 0.8) is None
    assert share_warning(0.0, 0, {}, {}, 0.0) is None


def test_without_causes_or_a_token_count_the_sentence_still_reads():
    warning = share_warning(0.5, None, {"stale": 0}, {}, 0.9)
    assert warning == (
        "only 50% of the tokens the trainer's sessions sampled trained "
        "(min_trained_share 0.9); the biggest causes: none counted"
    )


def test_ties_are_ordered_by_name_so_the_text_is_stable():
    warning = share_warning(0.1, 10, {"b": 3, "a": 3}, {}, 0.5)
    assert warning is not None and warning.endswith("3 tokens masked as a; 3 tokens masked as b")


def test_a_run_with_no_step_warns_when_the_trainer_dropped_what_it_claimed():
    assert untrained_warning({}) is None
    assert untrained_warning({"stale": 0}) is None
    assert untrained_warning({"stale": 4, "incomplete_group": 2, "x": 1, "y": 1}) == (
        "no step has trained anything yet; 8 sessions the trainer claimed were dropped: "
        "4 as stale, 2 as incomplete_group, 1 as x"
    )
