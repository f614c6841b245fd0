"""Streamed events survive a client that splits lines the Unicode way: a ``data:`` line holds no
U+0085, U+2028 or U+2029 (nor any other line end), and its JSON still reads back as sent.
JavaScript EventSource polyfills and Python's str.splitlines split there."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from server.proxy.streaming import sse

LINE_ENDS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
text = st.text(alphabet=st.sampled_from(LINE_ENDS) | st.characters(codec="utf-8"), max_size=40)
payloads = st.recursive(
    st.none() | st.booleans() | st.integers() | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


@given(st.dictionaries(text, payloads, max_size=4), st.sampled_from([None, "delta"]))
def test_every_event_splits_into_its_own_lines_and_reads_back(payload, event):
    lines = sse(payload, event).splitlines()  # every Unicode line end counts here
    *named, data, blank = lines
    assert named == ([] if event is None else [f"event: {event}"]) and blank == ""
    assert data.startswith("data: ")
    assert json.loads(data.removeprefix("data: ")) == payload


def test_the_three_unicode_line_ends_are_escaped():
    event = sse({"content": "a\x85b\u2028c\u2029d"})
    assert event == 'data: {"content": "a\\u0085b\\u2028c\\u2029d"}\n\n'
