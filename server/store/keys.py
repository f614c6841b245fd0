"""API keys: random, shown once, stored only as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets


def new_key(prefix: str) -> tuple[str, str]:
    """A fresh key and the hash to store for it."""
    key = f"{prefix}-{secrets.token_urlsafe(32)}"
    return key, hash_key(key)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"
