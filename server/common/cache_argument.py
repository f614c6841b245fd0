"""The keyword under which a transformers model's ``forward`` takes its KV cache.

transformers 5.24.0 renamed the argument ``past_key_values`` to ``cache`` (the output field too).
The old name still works there through a shim that raises a ``FutureWarning`` on every call and
is announced for removal in 5.40.0; releases before 5.24 know only ``past_key_values``. The name
is read once per model, when it is loaded, from the model's own ``forward`` signature rather
than from the version number: a model whose code is not transformers' own (``trust_remote_code``)
may keep the old name on a new release.

Callers pass the cache as ``model(..., **{keyword: cache})`` with the keyword this returns, and
keep the cache object they passed (it is updated in place) instead of reading it back from the
output. This module knows nothing of what a cache holds.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["NEW", "OLD", "cache_keyword"]

NEW = "cache"  # transformers >= 5.24.0
OLD = "past_key_values"  # transformers < 5.24.0; deprecated from 5.24.0, removed in 5.40.0


def cache_keyword(model: Any) -> str:
    """``"cache"`` when ``model.forward`` takes it, else ``"past_key_values"``."""
    return NEW if NEW in inspect.signature(model.forward).parameters else OLD
