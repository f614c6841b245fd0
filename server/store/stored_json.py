"""Whether a JSON value can be stored and served back: every string encodable as UTF-8 (Python's
``json`` turns the escape ``"\\ud800"`` into a lone surrogate, which no UTF-8 writer takes), every
number finite (Python's ``json`` reads ``NaN`` and ``Infinity``, which no JSON writer may write
and Postgres refuses) and nesting no deeper than a bound (the answer's serializer stops at about
255 levels).

The door (``server.limits``) refuses request bodies that fail it; the readers (claims, session
views, exports) check what an older version may have stored before they serve it. Pure: this
module knows nothing about HTTP or SQL.
"""

from __future__ import annotations

import math
import re
from typing import Any

# Deepest nesting a reader serves: under the serializer's limit, with room for the answer's own
# levels around a stored value (a claim's sessions, a view's turns).
SERVABLE_DEPTH = 200
_SURROGATE = re.compile("[\ud800-\udfff]")


def problem(value: Any, max_depth: int = SERVABLE_DEPTH) -> str | None:
    """What keeps ``value`` (parsed JSON) from being stored and served, with where it is
    (``a.b[3]``); None when nothing does. Walks without recursion: any depth is safe."""
    # Each entry: the value, its depth, and the entry it sits in with its key there (the path
    # is spelled out only for the answer).
    stack: list[tuple[Any, int, Any, object]] = [(value, 0, None, None)]
    while stack:
        entry = stack.pop()
        item, depth = entry[0], entry[1]
        if not isinstance(item, dict | list):
            wrong = _leaf_problem(item)
            if wrong:
                return wrong + _at(entry)
        elif depth >= max_depth:
            return f"nesting deeper than {max_depth} levels{_at(entry)}"
        elif isinstance(item, dict):
            for key, inner in item.items():
                if not key.isascii() and _SURROGATE.search(key):
                    return f"a key UTF-8 cannot encode (a lone surrogate){_at(entry)}"
                if isinstance(inner, str | dict | list | float):
                    stack.append((inner, depth + 1, entry, key))
        else:
            stack.extend(
                (inner, depth + 1, entry, i)
                for i, inner in enumerate(item)
                if isinstance(inner, str | dict | list | float)
            )
    return None


def _leaf_problem(item: Any) -> str | None:
    if isinstance(item, str) and not item.isascii() and _SURROGATE.search(item):
        return "a string UTF-8 cannot encode (a lone surrogate)"
    if isinstance(item, float) and not math.isfinite(item):
        return "a number JSON cannot hold (NaN or Infinity)"
    return None


def _at(entry: tuple[Any, int, Any, object]) -> str:
    keys = []
    while entry[2] is not None:
        keys.append(entry[3])
        entry = entry[2]
    where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys))
    return f" at {_printable(where.lstrip('.'))}" if where else ""


def _printable(where: str) -> str:
    """``where`` as a message can carry it (a key may hold the very surrogate), cut short."""
    text = _SURROGATE.sub("\ufffd", where)
    return text if len(text) <= 200 else text[:199] + "…"
