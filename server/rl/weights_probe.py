"""``POST /admin/weights/probe``: can this server and its engines read what the trainer writes?

The trainer (``publish.mode=disk``) writes a probe file under its ``output_dir/weights/`` and
asks here before it trains (server/common/weights_probe.py says what a probe is). The replica
that leads reads the file itself (within the probe's read bound), as its publishes check the
files, and asks at once every engine a publish would load (``pool.loadable``), each within
:data:`ENGINE_WAIT_S`; a follower forwards the probe to the leader, as it forwards a swap. An
engine out of rotation, or that did not answer, is ``answered: false`` (the trainer warns: it
cannot tell); one that answered it cannot read the file stops the trainer. An engine without the
probe route (SGLang answers 404: it has no endpoint that reads a file without loading it) cannot
be asked: its answer is ``checked: false``, and the trainer says so.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from server.common import weights_probe
from server.context import ServerContext
from server.engine_client.pool import EngineState
from server.errors import EngineError, EngineRejected

ENGINE_WAIT_S = 30.0


class WeightsProbeIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)] = Field(
        description=f"Absolute path of the trainer's probe file (named {weights_probe.PROBE_NAME})."
    )
    token: Annotated[str, StringConstraints(min_length=1, max_length=weights_probe.TOKEN_CHARS)] = (
        Field(description="What the probe file holds.")
    )

    @field_validator("path")
    @classmethod
    def _probe_path(cls, path: str) -> str:
        problem = weights_probe.name_problem(path)
        if problem is not None:
            raise ValueError(problem)
        return path


class ProbeReader(BaseModel):
    url: str | None = Field(description="The engine's URL; null: this server.")
    checked: bool = Field(description="False: this reader cannot be asked (SGLang).")
    answered: bool = Field(
        description="False: it was not asked (out of rotation) or did not answer in time."
    )
    readable: bool = Field(description="It found the file holding the token.")
    problem: str | None = Field(description="Why not, in words.")


class WeightsProbeOut(BaseModel):
    readable: bool = Field(
        description="This server and every engine that answered read it (see each reader)."
    )
    server: ProbeReader
    engines: list[ProbeReader]


async def probe(ctx: ServerContext, body: WeightsProbeIn) -> WeightsProbeOut:
    loadable = ctx.pool.loadable
    own, asked = await asyncio.gather(
        weights_probe.read_problem_within(body.path, body.token),
        asyncio.gather(*(_ask(e, body) for e in loadable)),
    )
    server = ProbeReader(url=None, checked=True, answered=True, readable=own is None, problem=own)
    down = [
        ProbeReader(url=e.url, checked=True, answered=False, readable=False, problem=DOWN)
        for e in ctx.pool.engines
        if e not in loadable
    ]
    engines = [*asked, *down]
    stopping = [e for e in engines if e.checked and e.answered and not e.readable]
    readable = server.readable and not stopping
    return WeightsProbeOut(readable=readable, server=server, engines=engines)


DOWN = "out of rotation (down, or not ready to serve): not asked, as a publish would not load it"


async def _ask(engine: EngineState, body: WeightsProbeIn) -> ProbeReader:
    try:
        async with asyncio.timeout(ENGINE_WAIT_S):
            problem = await engine.client.weights_probe(body.path, body.token)
    except EngineRejected as exc:
        if exc.engine_status == 404:
            why = "this engine has no probe route (SGLang's own): it cannot be checked"
            return _reader(engine, checked=False, answered=True, problem=why)
        problem = f"the engine refused the probe: {exc}"
    except (EngineError, TimeoutError) as exc:
        why = f"the engine did not answer the probe: {exc or f'not within {ENGINE_WAIT_S:g} s'}"
        return _reader(engine, checked=True, answered=False, problem=why)
    return _reader(engine, checked=True, answered=True, problem=problem)


def _reader(engine: EngineState, checked: bool, answered: bool, problem: str | None) -> ProbeReader:
    readable = checked and answered and problem is None
    return ProbeReader(
        url=engine.url, checked=checked, answered=answered, readable=readable, problem=problem
    )
