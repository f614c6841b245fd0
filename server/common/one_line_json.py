"""JSON that stays on one line whoever splits it: ``json.dumps`` (UTF-8 text, not ``\\u``
escapes) with the Unicode line ends it leaves raw, U+2028, U+2029 and U+0085, escaped. Readers
that split on Unicode line ends (Python's ``str.splitlines``, JavaScript's line readers, some
editors) would otherwise cut a JSON Lines record or an SSE ``data:`` line there. Only strings can
hold them, so the escaped JSON is the same value."""

from __future__ import annotations

import json
from typing import Any

_LINE_ENDS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\u0085": "\\u0085"})


def dumps(value: Any, **options: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, **options)`` with no raw line end but ``\\n``
    (which JSON escapes itself)."""
    return json.dumps(value, ensure_ascii=False, **options).translate(_LINE_ENDS)
