"""The engine as the HTTP layer sees it: generation streams, weight updates, groups, info.

It owns the model runner, the scheduler thread and the weight-update groups, and turns
scheduler events into asyncio streams. Blocking work (reading checkpoints, joining a process
group, receiving a broadcast) runs in worker threads so the event loop keeps serving. This module
knows nothing about HTTP status codes or JSON shapes beyond SGLang's result dicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import torch

from server.common import weight_transfer as weights
from server.engine import protocol
from server.engine.lora import AdapterError
from server.engine.protocol import EngineInputError, GenerateItem
from server.engine.responses import RenderOptions, StreamRenderer, final_output
from server.engine.runner import ModelRunner, RunnerConfig
from server.engine.sampling import RowSampling
from server.engine.scheduler import (
    DuplicateRequestId,
    Scheduler,
    SchedulerConfig,
    UpdateResult,
    WeightUpdate,
)
from server.engine.sequence import GenerationParams, LogprobRequest, Sequence
from server.engine.settings import EngineSettings

log = logging.getLogger(__name__)


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Run ``callback(*args)`` on ``loop`` from the scheduler thread; nothing if the loop has
    closed (a shutdown's last aborts reach listeners whose callers are gone)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


HEALTH_TIMEOUT_S = 20.0
ENGINE_VERSION = "proxrl-embedded-0.1 (SGLang 0.5.23 protocol)"


@dataclass
class Event:
    index: int
    tokens: int
    finished: bool


class EngineService:
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        device = "cuda" if settings.device == "auto" and torch.cuda.is_available() else "cpu"
        if settings.device != "auto":
            device = settings.device
        self.runner = ModelRunner(
            RunnerConfig(
                model_path=settings.model,
                device=device,
                dtype=settings.resolved_dtype(device),
                max_slots=settings.max_running_requests,
                context_length=settings.context_length,
                prefill_chunk=settings.prefill_chunk,
                max_loaded_loras=settings.max_loaded_loras,
            )
        )
        self.scheduler = Scheduler(
            self.runner,
            SchedulerConfig(
                max_running_requests=settings.max_running_requests,
                max_prefill_tokens=settings.max_prefill_tokens,
                stream_interval=settings.stream_interval,
                weight_version=settings.weight_version,
                seed=settings.seed,
                prefix_cache_bytes=settings.prefix_cache_mb << 20,
                prefix_cache_min_tokens=settings.prefix_cache_min_tokens,
            ),
        )
        self.served_model_name = settings.served_model_name or settings.model
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.update_session_open = False
        self.started_at = time.time()

    def close(self) -> None:
        """Stop the scheduler and leave every weight-update group."""
        self.scheduler.stop()
        for group in self.groups.values():
            weights.leave_group(group)
        self.groups.clear()

    # ----- generation ----------------------------------------------------------------------

    def parse(self, request: protocol.GenerateRequestIn) -> tuple[list[GenerateItem], bool]:
        tokenizer = self.runner.tokenizer
        return protocol.expand(
            request,
            encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
            vocab_size=self.runner.vocab_size,
            context_length=self.runner.context_length,
            new_rid=lambda: uuid.uuid4().hex,
        )

    def render_options(self, request: protocol.GenerateRequestIn, index: int | None):
        return RenderOptions(
            decode=self.runner.decode_text,
            return_prompt_token_ids=request.return_prompt_token_ids,
            batch_index=index,
        )

    def _submit(
        self, items: list[GenerateItem], stream: bool, events: asyncio.Queue
    ) -> list[Sequence]:
        loop = asyncio.get_running_loop()
        bank = self.runner.adapters
        try:  # every adapter held now, or none: an unload cannot slip in before submission
            adapters = bank.acquire([item.lora_name for item in items])
        except AdapterError as exc:
            raise EngineInputError(str(exc)) from exc
        sequences: list[Sequence] = []
        for item, adapter in zip(items, adapters, strict=True):

            def listener(tokens: int, finished: bool, index: int = item.index) -> None:
                _post(loop, events.put_nowait, Event(index, tokens, finished))

            seq = Sequence(
                rid=item.rid,
                prompt_ids=item.prompt_ids,
                params=item.params,
                logprobs=item.logprobs,
                stream=stream,
                listener=listener,
                adapter=adapter,
            )
            try:
                self.scheduler.submit(seq)
            except DuplicateRequestId as exc:
                self.abort_sequences(sequences)  # their adapters go back as they finish
                for unsubmitted in adapters[len(sequences) :]:
                    bank.release(unsubmitted)
                raise EngineInputError(str(exc)) from exc
            sequences.append(seq)
        return sequences

    def abort_sequences(self, sequences: list[Sequence]) -> None:
        rids = [seq.rid for seq in sequences if not seq.finished]
        if rids:
            for rid in rids:
                self.scheduler.abort_soon(rid, exact=True)

    async def generate(
        self, request: protocol.GenerateRequestIn, items: list[GenerateItem]
    ) -> list[dict]:
        """Run every item to the end; their outputs in item order."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        sequences = self._submit(items, stream=False, events=events)
        try:
            remaining = len(sequences)
            while remaining:
                event = await events.get()
                remaining -= event.finished
        except BaseException:
            self.abort_sequences(sequences)
            raise
        return [final_output(seq, self.render_options(request, None)) for seq in sequences]

    def generate_stream(
        self, request: protocol.GenerateRequestIn, items: list[GenerateItem], batch: bool
    ) -> AsyncIterator[dict]:
        """Submit now (a duplicate rid raises here); chunks come as tokens arrive, and the last
        chunk of each item carries its finish_reason."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        sequences = self._submit(items, stream=True, events=events)
        incremental = self.settings.incremental_streaming_output
        renderers = [
            StreamRenderer(seq, self.render_options(request, i if batch else None), incremental)
            for i, seq in enumerate(sequences)
        ]
        return self._chunks(sequences, renderers, events)

    async def _chunks(
        self,
        sequences: list[Sequence],
        renderers: list[StreamRenderer],
        events: asyncio.Queue[Event],
    ) -> AsyncIterator[dict]:
        try:
            remaining = len(sequences)
            while remaining:
                event = await events.get()
                chunk = renderers[event.index].chunk(event.tokens)
                if chunk is not None:
                    yield chunk
                remaining -= event.finished
        finally:
            self.abort_sequences(sequences)

    async def health_generate(self) -> bool:
        """Generate one token through the scheduler; False if none comes within 20 s."""
        # UNVERIFIED in the reference (section 3.1, derived from SGLang's code, not observed at
        # runtime): during a pause the health request is held like any other, so it times out
        # after 20 s and answers 503. We do the same: submit() holds it while paused.
        if not self.scheduler.alive:
            return False
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def listener(tokens: int, finished: bool) -> None:
            if finished:
                _post(loop, done.set)

        seq = Sequence(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            prompt_ids=[0],
            params=GenerationParams(max_new_tokens=1, sampling=RowSampling(temperature=0.0)),
            logprobs=LogprobRequest(),
            listener=listener,
            internal=True,
        )
        self.scheduler.submit(seq)
        try:
            await asyncio.wait_for(done.wait(), HEALTH_TIMEOUT_S)
            return True
        except TimeoutError:
            self.abort_sequences([seq])
            return False

    async def health(self) -> bool:
        if os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in (
            "0",
            "false",
        ):
            return self.scheduler.alive
        return await self.health_generate()

    # ----- control --------------------------------------------------------------------------

    async def run(self, fn):
        return await asyncio.wrap_future(self.scheduler.call(fn))

    async def apply_update(self, update: WeightUpdate) -> UpdateResult:
        try:
            tensors = await asyncio.to_thread(self.runner.model_named, update.tensors)
            self.runner.check_weights(tensors)
        except (ValueError, OSError) as exc:
            return UpdateResult(False, f"Failed to update weights: {exc}")
        update = replace(update, tensors=tensors)
        return await asyncio.wrap_future(self.scheduler.request_update(update))

    async def update_from_disk(self, body: protocol.UpdateWeightsFromDiskIn) -> UpdateResult:
        try:
            tensors = await asyncio.to_thread(weights.read_checkpoint, body.model_path)
        except (weights.WeightLoadError, OSError) as exc:
            return UpdateResult(False, f"Failed to load weights from {body.model_path}: {exc}")
        result = await self.apply_update(
            WeightUpdate(
                tensors=tensors,
                version=body.weight_version,
                abort_all=body.abort_all_requests,
                flush_cache=body.flush_cache,
                model_path=body.model_path,
            )
        )
        if result.success:
            self.served_model_name = body.model_path
        return result

    async def init_group(self, body: protocol.InitWeightsUpdateGroupIn) -> UpdateResult:
        if body.group_name in self.groups:
            return UpdateResult(False, f"group {body.group_name!r} already exists")
        if body.backend == "nccl" and self.runner.device.type != "cuda":
            return UpdateResult(False, "backend nccl needs CUDA; this engine runs on CPU: use gloo")
        try:
            group = await asyncio.to_thread(
                weights.join_group,
                body.master_address,
                body.master_port,
                body.rank_offset,  # tensor-parallel rank 0 of this engine
                body.world_size,
                body.group_name,
                body.backend,
            )
        except Exception as exc:  # a failed rendezvous must not take the engine down
            return UpdateResult(False, f"Failed to init group: {exc}")
        self.groups[body.group_name] = group
        return UpdateResult(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, group_name: str) -> UpdateResult:
        group = self.groups.pop(group_name, None)
        if group is None:
            return UpdateResult(False, f"no group named {group_name!r}")
        await asyncio.to_thread(weights.leave_group, group)
        return UpdateResult(True, "Succeeded to destroy custom process group.")

    async def update_from_distributed(
        self, body: protocol.UpdateWeightsFromDistributedIn
    ) -> UpdateResult:
        if not self.update_session_open:
            return UpdateResult(
                False,
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()",
            )
        group = self.groups.get(body.group_name)
        if group is None:
            return UpdateResult(False, f"no group named {body.group_name!r}; init it first")
        try:
            tensors = await asyncio.to_thread(
                weights.receive_broadcast,
                group,
                body.names,
                body.dtypes,
                body.shapes,
                self.runner.device,
                body.load_format == "flattened_bucket",
            )
        except Exception as exc:
            return UpdateResult(False, f"Failed to receive weights: {exc}")
        return await self.apply_update(
            WeightUpdate(
                tensors=tensors,
                version=body.weight_version,
                abort_all=body.abort_all_requests,
                flush_cache=body.flush_cache,
            )
        )

    # ----- LoRA adapters --------------------------------------------------------------------

    async def load_adapter(self, body: protocol.LoadLoraAdapterIn) -> UpdateResult:
        """Read and check the adapter in a worker thread, then put it in service between two
        scheduler steps; nothing is held when it fails."""
        bank = self.runner.adapters
        try:
            adapter = await asyncio.to_thread(
                bank.read, body.lora_name, body.lora_path, body.pinned
            )
            await self.run(lambda: bank.add(adapter))
        except AdapterError as exc:
            return UpdateResult(False, str(exc))
        log.info("loaded LoRA adapter %s from %s", body.lora_name, body.lora_path)
        return UpdateResult(True, "")

    async def unload_adapter(self, body: protocol.UnloadLoraAdapterIn) -> UpdateResult:
        """Take the name out of service at once (new requests naming it are refused) and answer
        when the requests already holding it have ended and its tensors are dropped (as SGLang
        waits for them)."""
        bank = self.runner.adapters
        try:
            adapter = await self.run(lambda: bank.retire(body.lora_name))
        except AdapterError as exc:
            return UpdateResult(False, str(exc))
        await asyncio.wrap_future(adapter.freed)
        log.info("unloaded LoRA adapter %s", body.lora_name)
        return UpdateResult(True, "")

    def loaded_adapters(self) -> dict[str, str]:
        """Adapters in service: name -> the path it was loaded from (SGLang's shape)."""
        return {name: a.path for name, a in self.runner.adapters.loaded().items()}

    # ----- info -----------------------------------------------------------------------------

    def model_info(self) -> dict:
        return {
            "model_path": self.scheduler.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "load_format": "safetensors",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            **self.runner.model_info(),
        }

    def server_info(self) -> dict:
        settings = self.settings.model_dump(exclude={"api_key", "admin_api_key"})
        return {
            **settings,
            "model_path": self.settings.model,
            "context_length": self.runner.context_length,
            "tp_size": 1,
            "dp_size": 1,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.runner.context_length - 1,
            "internal_states": [
                {
                    "last_gen_throughput": self.scheduler.last_gen_throughput,
                    "prefix_cache": self.prefix_cache_info(),
                }
            ],
            "version": ENGINE_VERSION,
            "frontend": "python",
            "device": self.runner.device.type,
            "startup_time": self.started_at,
        }

    def prefix_cache_info(self) -> dict:
        """The prefix cache's counters; ``hit_rate``: prompt tokens reused / looked up."""
        cache = self.scheduler.prefix_cache
        stats = cache.stats.as_dict()
        looked_up = stats["looked_up_tokens"]
        return {
            **stats,
            "entries": len(cache),
            "bytes": cache.nbytes,
            "max_bytes": cache.max_bytes,
            "hit_rate": stats["reused_tokens"] / looked_up if looked_up else 0.0,
        }

    @property
    def max_total_num_tokens(self) -> int:
        return self.settings.max_running_requests * self.runner.context_length

    def loads(self) -> dict:
        load = self.scheduler.load()
        used = sum(s.kv_len for s in list(self.scheduler.running))
        return {
            "timestamp": time.time(),
            "version": ENGINE_VERSION,
            "accelerator": self.runner.device.type,
            "num_accelerators": 1,
            "loads": [
                {
                    "dp_rank": 0,
                    **load,
                    "num_used_tokens": used,
                    "max_total_num_tokens": self.max_total_num_tokens,
                    "token_usage": used / self.max_total_num_tokens,
                    "gen_throughput": self.scheduler.last_gen_throughput,
                    "cache_hit_rate": self.prefix_cache_info()["hit_rate"],
                    "paused": self.scheduler.paused,
                    "weight_version": self.scheduler.weight_version,
                }
            ],
        }
