"""Admin keys and the dashboard's login cookie.

Keys: never empty; off loopback, 32+ characters and 8+ different ones, for ``proxrl serve``
and ``proxrl engine`` alike, with a message that says how to make one. The cookie: signed under
the store's secret over the admin key's hash and an expiry, so one made from the key alone, one
past its expiry, one altered in any character, one signed under another store's secret or for
another admin key opens nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import pytest
from pydantic import ValidationError

from server.common import admin_keys
from server.dashboard.access import cookie_valid, issue_cookie
from server.engine.settings import EngineSettings
from server.settings import ServerSettings

STRONG = "pV3x-q8Lr_T2mZ7cW1nYb6Kd0Hs9Jf4A"  # 32 characters, all different
OPEN_HOSTS = ["0.0.0.0", "192.168.1.5", "example.com", "::"]
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1"]
WEAK = {
    "short": "Zq8-xL2mR7",  # 10 characters
    "31 characters": STRONG[:31],
    "one character repeated": "a" * 64,
    "few different": "0123456" * 10,  # 70 characters, 7 different
}


@pytest.fixture(autouse=True)
def no_keys_in_the_environment(monkeypatch):
    for name in ("PROXRL_ADMIN_KEY", "PROXRL_ENGINE_API_KEY", "PROXRL_ENGINE_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)


def refusal(**fields) -> str:
    with pytest.raises(ValidationError) as raised:
        ServerSettings(model="m", **fields)
    return str(raised.value)


# ----- the rule --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", " ", "\n", "\t "])
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_an_empty_key_is_refused_everywhere(key, host):
    message = refusal(host=host, admin_key=key)
    assert "--admin-key (PROXRL_ADMIN_KEY) is empty" in message
    assert admin_keys.HOW_TO_MAKE_ONE in message


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_an_empty_key_from_the_environment_is_refused(monkeypatch, host):
    monkeypatch.setenv("PROXRL_ADMIN_KEY", "")
    assert "is empty" in refusal(host=host)


def test_a_key_with_whitespace_around_it_is_refused():
    # The login form strips what is typed: such a key could never log in.
    assert "whitespace" in refusal(admin_key=STRONG + "\n")


@pytest.mark.parametrize("host", OPEN_HOSTS)
@pytest.mark.parametrize("name", sorted(WEAK))
def test_a_weak_key_is_refused_off_loopback(host, name):
    key = WEAK[name]
    message = refusal(host=host, admin_key=key)
    assert f"refusing to serve on {host} with a weak --admin-key" in message
    assert f"{len(key)} characters, {len(set(key))} different" in message
    assert admin_keys.HOW_TO_MAKE_ONE in message
    assert key not in message  # the refusal does not repeat the key


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
@pytest.mark.parametrize("key", ["test-admin-key", *WEAK.values()])
def test_any_non_empty_key_serves_on_loopback(host, key):
    assert ServerSettings(model="m", host=host, admin_key=key).admin_key == key


@pytest.mark.parametrize("host", OPEN_HOSTS)
def test_a_strong_key_serves_off_loopback(host):
    assert ServerSettings(model="m", host=host, admin_key=STRONG).admin_key == STRONG


def test_keys_made_as_the_message_says_pass():
    # As the message says (64 hex digits), as `openssl rand -hex 16` does (32), and urlsafe.
    # Hex keys never begin with "-", which argparse would take for a flag after --admin-key.
    for _ in range(2000):
        for key in (secrets.token_hex(32), secrets.token_hex(16), secrets.token_urlsafe(32)):
            assert admin_keys.problem(key, "--admin-key", "0.0.0.0") is None


def test_a_missing_key_off_loopback_says_how_to_make_one():
    message = refusal(host="0.0.0.0")
    assert "refusing to serve on 0.0.0.0 without an admin key" in message
    assert admin_keys.HOW_TO_MAKE_ONE in message


@pytest.mark.parametrize("flag", ["api_key", "admin_api_key"])
def test_the_engine_keys_follow_the_same_rule(flag):
    dashed = "--" + flag.replace("_", "-")
    for host in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ValidationError, match=f"{dashed} is empty"):
            EngineSettings(model="m", host=host, **{flag: ""})
    with pytest.raises(ValidationError, match=f"with a weak {dashed}: 10 characters"):
        EngineSettings(model="m", host="0.0.0.0", **{flag: WEAK["short"]})
    assert getattr(EngineSettings(model="m", **{flag: "short"}), flag) == "short"  # loopback
    assert getattr(EngineSettings(model="m", host="0.0.0.0", **{flag: STRONG}), flag) == STRONG


# ----- the cookie ------------------------------------------------------------------------------

SECRET = bytes(range(32))
KEY_HASH = hashlib.sha256(STRONG.encode()).hexdigest()
NOW = 1_800_000_000


def test_a_cookie_is_good_until_it_expires():
    cookie = issue_cookie(SECRET, KEY_HASH, NOW + 3600)
    assert cookie_valid(cookie, SECRET, KEY_HASH, NOW)
    assert cookie_valid(cookie, SECRET, KEY_HASH, NOW + 3599.9)
    assert not cookie_valid(cookie, SECRET, KEY_HASH, NOW + 3600)
    assert not cookie_valid(cookie, SECRET, KEY_HASH, NOW + 86400)


def test_a_cookie_holds_nothing_of_the_key():
    cookie = issue_cookie(SECRET, KEY_HASH, NOW + 3600)
    assert STRONG not in cookie and KEY_HASH not in cookie and SECRET.hex() not in cookie


def test_a_cookie_made_from_the_key_alone_is_refused():
    """Whoever knows (or guesses) the key but not the store's secret cannot make one: neither
    the old way (an HMAC of a fixed label under the key) nor ours with the key as secret."""
    old_way = hmac.new(STRONG.encode(), b"proxrl dashboard session v1", hashlib.sha256)
    assert not cookie_valid(old_way.hexdigest(), SECRET, KEY_HASH, NOW)
    for guess in (STRONG.encode(), KEY_HASH.encode(), b""):
        forged = issue_cookie(guess, KEY_HASH, NOW + 3600)
        assert not cookie_valid(forged, SECRET, KEY_HASH, NOW)


def test_a_cookie_from_another_store_or_for_another_key_is_refused():
    cookie = issue_cookie(SECRET, KEY_HASH, NOW + 3600)
    other_store = secrets.token_bytes(32)
    assert not cookie_valid(cookie, other_store, KEY_HASH, NOW)
    new_key_hash = hashlib.sha256(b"a new admin key").hexdigest()
    assert not cookie_valid(cookie, SECRET, new_key_hash, NOW)  # changing the key logs out


def test_a_tampered_cookie_is_refused():
    cookie = issue_cookie(SECRET, KEY_HASH, NOW + 3600)
    version, expiry, signature = cookie.split(".")
    later = f"{version}.{int(expiry) + 86400}.{signature}"  # a longer life, same signature
    assert not cookie_valid(later, SECRET, KEY_HASH, NOW)
    for index in range(len(cookie)):
        for replacement in ("0", "f", "."):
            altered = cookie[:index] + replacement + cookie[index + 1 :]
            if altered != cookie:
                assert not cookie_valid(altered, SECRET, KEY_HASH, NOW), altered
    for cut in range(len(cookie)):
        assert not cookie_valid(cookie[:cut], SECRET, KEY_HASH, NOW)
    assert not cookie_valid(cookie + "0", SECRET, KEY_HASH, NOW)


GARBAGE = [
    "", ".", "..", "v2", "v2..", "v1.9999999999.00", "v2.-5.00", "v2.\uff11\uff12.00",
    "v2.9" * 100, "v2." + "9" * 5000 + ".00", "v2.9999999999.\u00fcn\u00efc\u00f6d\u00e9",
]  # fmt: skip


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_is_refused_without_an_error(garbage):
    assert not cookie_valid(garbage, SECRET, KEY_HASH, NOW)
