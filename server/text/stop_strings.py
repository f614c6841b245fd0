"""Stop strings in streamed text: how much of the end must wait until it is clear."""

from __future__ import annotations


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is the start of a stop string (and could
    still grow into one), so a stream does not send what is then cut."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-size:]):
                longest = size
                break
    return longest
