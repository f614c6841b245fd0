"""The rule an admin key meets: never empty; where the server is reachable from other
machines, long and varied enough that nobody guesses it.

Pure: it knows neither the proxy nor the engine, only a key, the flag it came from and the
address the server binds. ``proxrl serve`` and ``proxrl engine`` both check their keys here.
"""

from __future__ import annotations

import ipaddress

MIN_LENGTH = 32
MIN_DISTINCT = 8  # characters: "aaaa...a" or "1212...12" is long and still guessed at once;
# 8, not more: 32 hex characters (`openssl rand -hex 16`) have fewer than 8 different ones
# with a probability below 1e-6, where "16 different" refused a quarter of 64-hex-digit keys
HOW_TO_MAKE_ONE = 'python -c "import secrets; print(secrets.token_hex(32))"'


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def problem(key: str | None, flag: str, host: str) -> str | None:
    """What is wrong with ``key`` (given as ``flag``) for a server bound to ``host``, or None.

    A key that is absent is not judged here: whether a server may run without one is the
    caller's rule. A key that is present is never empty or padded with whitespace (an empty
    ``--admin-key ''`` or ``PROXRL_ADMIN_KEY=`` is never meant); off loopback it also has at
    least ``MIN_LENGTH`` characters, ``MIN_DISTINCT`` of them different."""
    if key is None:
        return None
    if not key.strip():
        return f"{flag} is empty: give a key; make one with {HOW_TO_MAKE_ONE}"
    if key != key.strip():
        return f"{flag} starts or ends with whitespace (a pasted newline?): remove it"
    if is_loopback(host):
        return None
    distinct = len(set(key))
    if len(key) < MIN_LENGTH or distinct < MIN_DISTINCT:
        return (
            f"refusing to serve on {host} with a weak {flag}: {len(key)} characters, {distinct} "
            f"different, where off loopback it needs {MIN_LENGTH}+ characters, {MIN_DISTINCT}+ "
            f"different; make one with {HOW_TO_MAKE_ONE}"
        )
    return None
