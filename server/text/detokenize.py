"""Text of a growing token sequence, a delta at a time, decoding only a short window.

Decoding the whole sequence after every token costs O(n^2); this decodes the tokens since a
recent boundary twice (with and without the newest ones) and keeps the difference, which is
exact for byte-level and SentencePiece tokenizers alike. A delta ending in half a UTF-8
character is held until the rest arrives. This module knows only a ``decode`` function.
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]


class IncrementalDecoder:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here
        self._read = 0  # text of ids[:_read] has been returned

    def push(self, ids: list[int]) -> str:
        """Add tokens; the new text they complete (may be "" while a character is split)."""
        self.ids += ids
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """Whatever is still held at the end, replacement characters included."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :]
