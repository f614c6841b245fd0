"""``ServerSettings``: the server never binds an open address without an admin key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from server.settings import ServerSettings


@pytest.fixture(autouse=True)
def no_admin_key_in_the_environment(monkeypatch):
    monkeypatch.delenv("PROXRL_ADMIN_KEY", raising=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5", "example.com", "::"])
def test_an_open_address_without_a_key_is_refused(host):
    with pytest.raises(ValidationError) as raised:
        ServerSettings(model="m", host=host)
    message = str(raised.value)
    assert f"refusing to serve on {host} without an admin key" in message
    assert "--admin-key" in message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_a_loopback_address_needs_no_key(host):
    settings = ServerSettings(model="m", host=host)
    assert settings.admin_key is None and settings.binds_loopback


STRONG_KEY = "pV3x-q8Lr_T2mZ7cW1nYb6Kd0Hs9Jf4A"  # 32 characters, all different


def test_an_open_address_with_a_strong_key_is_accepted():
    settings = ServerSettings(model="m", host="0.0.0.0", admin_key=STRONG_KEY)
    assert settings.admin_key == STRONG_KEY and not settings.binds_loopback


def test_the_key_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PROXRL_ADMIN_KEY", STRONG_KEY)
    assert ServerSettings(model="m", host="0.0.0.0").admin_key == STRONG_KEY
