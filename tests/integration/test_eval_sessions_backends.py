"""Evaluation sessions against a real ``proxrl serve`` on SQLite and on PostgreSQL: never
claimed, admitted at a full staleness bound, refused in a group of training sessions, and their
rewards by policy version and task (the version read from the stored turns' bytes, which each
backend slices in its own SQL) against a float64 reference. The scenarios are
``tests/eval_scenarios.py``'s, which the in-process API tier runs too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import eval_scenarios as scenarios
from tests.support import ProxyProcess, RestClient

BOTH = pytest.mark.parametrize("proxy", ["sqlite", "postgres"], indirect=True, scope="module")


@dataclass
class Proxy(RestClient):
    process: ProxyProcess
    http: httpx.Client
    model_dir: Path


@pytest.fixture(scope="module")
def proxy(request, tiny_model_dir, tmp_path_factory):
    """``proxrl serve`` on SQLite or on a fresh PostgreSQL database (the test's parameter)."""
    backend = request.param
    extra = []
    if backend == "postgres":
        extra = ["--db", request.getfixturevalue("postgres").new_database()]
    data_dir = tmp_path_factory.mktemp(f"eval-{backend}")
    with (
        ProxyProcess(tiny_model_dir, data_dir, *extra) as process,
        httpx.Client(base_url=process.url, timeout=120) as http,
    ):
        yield Proxy(process, http, tiny_model_dir)


@BOTH
def test_eval_sessions_are_never_claimed(proxy):
    scenarios.eval_sessions_are_never_claimed(proxy)


@BOTH
def test_eval_sessions_are_admitted_at_a_full_staleness_bound(proxy):
    scenarios.eval_sessions_are_admitted_at_the_bound(proxy)


@BOTH
def test_a_group_id_is_all_eval_sessions_or_none(proxy):
    scenarios.a_group_is_all_eval_or_none(proxy)


@BOTH
def test_eval_rewards_by_version_and_task_match_a_float64_reference(proxy):
    scenarios.eval_rewards_by_version_and_task(proxy, proxy.model_dir)
