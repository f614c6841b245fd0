"""What the benchmark scripts share: argument types, new sessions on a proxy."""

from __future__ import annotations

import argparse

import httpx


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


async def new_sessions(url: str, admin: dict[str, str], count: int) -> list[dict]:
    """``count`` new sessions on the proxy at ``url`` (``admin``: its admin key headers):
    each one's id, api_key and base_url."""
    async with httpx.AsyncClient(headers=admin, timeout=60) as http:
        replies = [
            await http.post(f"{url}/rl/sessions", json={"task_id": "bench"}) for _ in range(count)
        ]
    for reply in replies:
        reply.raise_for_status()
    return [reply.json() for reply in replies]
