"""The dashboard's login cookie as the Cookie header carries it: the document bounds its value at
4096 characters, and a value is what the header holds up to the first ``;``.

The API fuzz test once sent ``proxrl_admin=d^~%^wdKx;*???...`` (4104 characters) and counted the
200 an over-long cookie accepted; the header holds a 9-character cookie and a nameless one, so the
admin's bearer key was what let it in (tests/integration/proxy_fuzz_hooks.py now sends generated
values in cookie-octets)."""

from __future__ import annotations

from server.deps import CREDENTIAL_MAX_CHARS
from tests.api.api_support import NO_KEY, Api, assert_error

FUZZED = "d^~%^wdKx;*" + "?" * 4093  # the fuzz test's value, as it was sent


def series(api: Api) -> str:
    """A run's series path in the dashboard API."""
    run = api.new_run()
    return f"/admin/api/runs/{run['id']}/series"


def test_a_semicolon_ends_the_cookie_so_the_fuzzed_header_is_a_short_cookie(api: Api):
    path = series(api)
    header = {"Cookie": f"proxrl_admin={FUZZED}"}
    assert len(FUZZED) > CREDENTIAL_MAX_CHARS
    # Read as the 9 characters before the ';': not a login cookie, so no key is a 401, not a 422.
    reply = api.call("GET", path, key=NO_KEY, headers=header)
    assert_error(reply, 401)
    assert api.ok("GET", path, headers=header)["steps"] == []


def test_an_over_long_cookie_is_refused_before_it_is_checked(api: Api):
    path = series(api)
    long_cookie = FUZZED.replace(";", "_")
    assert len(long_cookie) > CREDENTIAL_MAX_CHARS
    header = {"Cookie": f"proxrl_admin={long_cookie}"}
    assert_error(api.call("GET", path, headers=header), 422)
    assert_error(api.call("GET", path, key=NO_KEY, headers=header), 422)
    at_the_bound = {"Cookie": "proxrl_admin=" + "x" * CREDENTIAL_MAX_CHARS}
    assert_error(api.call("GET", path, key=NO_KEY, headers=at_the_bound), 401)
