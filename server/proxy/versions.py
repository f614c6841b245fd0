"""Which version of its run serves a request: the version it pins, else (a production session)
its run's promoted version, else the run's current one.

A request pins a version of its session's run by its model name, ``<served name or alias>@<N>``
or ``<run id>@<N>``, or by the ``X-Proxrl-Version: N`` header (both: they must agree). A name
``<other>@<N>`` is no pin (a model name may hold an ``@``, as Vertex AI's do) unless ``<other>``
is a run id, another run's: that is refused, as an unknown model. What cannot be served is
refused by ``RunAdapters.version`` (404, 410, 409). Turns record the model name as asked, and
each token the version that sampled it (``generation``). A pinned version outside the run's
kept window is an engine's *pinned* adapter, bounded per engine (``AdapterLoads``).

It knows nothing of any surface's shapes."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from server.bounds import MAX_INT
from server.context import ServerContext
from server.errors import InvalidRequest, ModelNotFound
from server.proxy.session_cache import SessionState
from server.store.run_adapters import ServedAdapter

if TYPE_CHECKING:
    from server.proxy.plan import Plan

VERSION_HEADER = "X-Proxrl-Version"
RUN_ID_PREFIX = "run-"  # every run's id begins so (``keys.new_id("run")``)


def pin_of(model: str, run_id: str, names: list[str]) -> int | None:
    """The version ``model`` pins (``<name>@<N>``, the name one of ``names`` or ``run_id``), or
    None where it pins none. ``<another run's id>@<N>`` is refused: a session is served only its
    own run's versions."""
    name, at, number = model.rpartition("@")
    if not at or not (number.isascii() and number.isdigit()):
        return None
    if name == run_id or name in names:
        if len(number) > len(str(MAX_INT)) or int(number) > MAX_INT:
            raise InvalidRequest(
                f"The model name pins a version past {MAX_INT}, which no run publishes.",
                param="model",
            )
        return int(number)
    if name.startswith(RUN_ID_PREFIX):
        raise ModelNotFound(model, [*names, f"{run_id}@<version>"])
    return None


def with_header(plan: Plan, header: int | None) -> Plan:
    """``plan`` pinned by the ``X-Proxrl-Version`` header's version too (refused where the model
    name pins another)."""
    if header is None or header == plan.version:
        return plan
    if plan.version is not None:
        raise InvalidRequest(
            f"The model name pins version {plan.version} and the {VERSION_HEADER} header "
            f"version {header}: give one of the two, or the same version in both.",
            param="model",
        )
    return dataclasses.replace(plan, version=header, version_param=VERSION_HEADER)


async def served(
    ctx: ServerContext, state: SessionState, version: int | None, param: str = "model"
) -> ServedAdapter | None:
    """The adapter that serves the request (None: the base model, or a full-weight run's
    weights), by its pin ``version`` (``param``: where it was given), else the session's."""
    adapters = ctx.run_adapters
    if version is None and state.production:
        serving = await adapters.serving(state.run_id)
        version = None if serving is None else serving.promoted
    if version is None:
        return await adapters.get(state.run_id)
    adapter = await adapters.version(state.run_id, version, param)
    serving = await adapters.serving(state.run_id)
    current = 0 if serving is None else serving.version
    if adapter is not None and adapter.version <= current - ctx.settings.adapters_kept:
        return dataclasses.replace(adapter, pinned=True)
    return adapter
