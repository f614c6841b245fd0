"""The door's scans of a JSON body (``server.limits``) say what a parse would, a piece at a time.

They run on a worker thread for bodies past 256 KiB, in steps that each hold the interpreter for
milliseconds (a megabyte, or one string), so that the event loop goes on. Checked against the
parsed value, by hypothesis: a lone surrogate, escaped (``"\\ud800"``) or as its own bytes; a
number past a double's range wherever it falls against the megabyte steps; brackets counted
outside strings only.
"""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from server import limits
from server.store import stored_json

# Text made of what the scans look at: surrogates, backslashes, quotes, brackets, escapes' letters.
TRICKY = st.text(
    alphabet=st.sampled_from(["\ud800", "\udc00", "\U0001f600", "\\", '"', "u", "d", "8", "[", "{"])
    | st.characters(),
    max_size=30,
)
VALUES = st.recursive(
    st.none() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
    max_leaves=12,
)


def has_lone_surrogate(value: object) -> bool:
    return stored_json.problem(value, 10_000) is not None


@settings(max_examples=400, deadline=None)
@given(VALUES)
def test_an_escaped_lone_surrogate_is_found_exactly_where_the_parsed_value_holds_one(value):
    body = json.dumps(value).encode()  # ensure_ascii: every surrogate is an escape
    assert limits._lone_escape(body) == has_lone_surrogate(value)
    problem = limits.json_problem(body, 10_000)
    assert (problem is not None) == has_lone_surrogate(value), (body, problem)


@settings(max_examples=200, deadline=None)
@given(VALUES)
def test_a_surrogate_written_as_its_own_bytes_is_refused(value):
    """JSON readers decode bytes with surrogatepass: ED A0 80 reads as a lone U+D800. The door
    let such bodies through (it looked for escapes only) and readers then failed on the row."""
    text = json.dumps(value, ensure_ascii=False)
    body = text.encode("utf-8", "surrogatepass")
    parsed = json.loads(body)
    assert (limits.json_problem(body, 10_000) is not None) == has_lone_surrogate(parsed)


def test_the_raw_bytes_of_a_surrogate_pair_are_two_lone_halves():
    body = '{"a": "\ud83d\ude00"}'.encode("utf-8", "surrogatepass")
    assert has_lone_surrogate(json.loads(body))  # what a route would have stored
    assert limits.json_problem(body, 64) == "a string UTF-8 cannot encode (a lone surrogate)"


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-12, max_value=12), st.sampled_from(["1e999", "-2E+400", "1e308"]))
def test_a_number_past_a_double_is_found_across_the_megabyte_steps(shift, number):
    """The exponent search runs a megabyte at a time: a number across a step's end is found."""
    at = limits._SCAN_STEP + shift
    padding = "x" * (at - len('["') - len('", '))
    body = f'["{padding}", {number}]'.encode()
    assert body.index(number.encode()) == at
    overflows = math.isinf(json.loads(body)[1])
    assert (limits.json_problem(body, 64) is not None) == overflows


@settings(max_examples=200, deadline=None)
@given(VALUES)
def test_containers_are_counted_outside_strings(value):
    body = json.dumps(value).encode()
    count = _containers_of(value)
    assert limits._containers(body, count) is None
    if count:
        assert limits._containers(body, count - 1) == count


def _containers_of(value: object) -> int:
    if isinstance(value, dict):
        return 1 + sum(_containers_of(inner) for inner in value.values())
    if isinstance(value, list):
        return 1 + sum(_containers_of(inner) for inner in value)
    return 0


def test_a_large_body_is_scanned_a_string_at_a_time_with_the_same_answer():
    """Past 256 KiB strings are taken out one match at a time (one substitution over a million
    strings held the interpreter for a second): the same bytes as the substitution."""
    body = json.dumps([{"k": 'a"b\\c', "n": [1, 2]}] * 20_000).encode()
    assert len(body) > limits.deps.OFF_LOOP_BYTES
    assert limits._outside_strings(body) == limits._STRING.sub(b"", body)
    assert limits._containers(body, 10_000) == 40_001
