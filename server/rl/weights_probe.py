"""``POST /admin/weights/probe``: can this server and its engines read what the trainer writes?

The trainer (``publish.mode=disk``) writes a probe file under its ``output_dir/weights/`` and
asks here before it trains (server/common/weights_probe.py says what a probe is). This server
reads the file itself and asks every engine to, at once, each within :data:`ENGINE_WAIT_S`. An
engine without the probe route (SGLang answers 404: it has no endpoint that reads a file without
loading it) cannot be asked: its answer is ``checked: false``, and the trainer says so.
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
    readable: bool = Field(description="It found the file holding the token.")
    problem: str | None = Field(description="Why not, in words.")


class WeightsProbeOut(BaseModel):
    readable: bool = Field(description="This server and every engine that could be asked read it.")
    server: ProbeReader
    engines: list[ProbeReader]


async def probe(ctx: ServerContext, body: WeightsProbeIn) -> WeightsProbeOut:
    own = await asyncio.to_thread(weights_probe.read_problem, body.path, body.token)
    engines = await asyncio.gather(*(_ask(e, body) for e in ctx.pool.engines))
    server = ProbeReader(url=None, checked=True, readable=own is None, problem=own)
    readable = server.readable and all(e.readable or not e.checked for e in engines)
    return WeightsProbeOut(readable=readable, server=server, engines=list(engines))


async def _ask(engine: EngineState, body: WeightsProbeIn) -> ProbeReader:
    try:
        async with asyncio.timeout(ENGINE_WAIT_S):
            problem = await engine.client.weights_probe(body.path, body.token)
    except EngineRejected as exc:
        if exc.engine_status == 404:
            why = "this engine has no probe route (SGLang's own): it cannot be checked"
            return ProbeReader(url=engine.url, checked=False, readable=False, problem=why)
        problem = f"the engine refused the probe: {exc}"
    except (EngineError, TimeoutError) as exc:
        problem = f"the engine did not answer the probe: {exc or 'timed out'}"
    return ProbeReader(url=engine.url, checked=True, readable=problem is None, problem=problem)
