"""The scheduler: continuous batching, pause / resume / abort, and weight swaps between steps.

One thread owns the model. Each turn of its loop it runs the commands other threads queued
(abort, pause, continue, weight updates, flushes), admits waiting requests into free KV slots
(prefill), and advances every running request by one token in a single batched forward pass.
Requests join and leave the batch at every step; a finished request frees its slot at once.

Pause modes follow SGLang 0.5.23 (see docs/architecture/sglang-protocol.md, "Pause modes"):

* ``abort``: every in-flight request finishes now with ``finish_reason.type == "abort"`` and the
  tokens it has; nothing resumes.
* ``retract``: running requests give up their KV slots and wait; after ``continue`` they are
  re-prefilled with prompt + tokens so far under the weights then loaded, in the same response.
* ``in_place``: stepping stops; after ``continue`` decoding goes on with the old KV.

In every mode new requests are held, not refused, until ``continue``. A weight update while not
paused waits until no request runs (new ones wait behind it), unless it asks to abort them all;
while paused it applies at once. Every token records the weight version that produced it.

This module knows nothing about HTTP; callers hand it :class:`Sequence` objects and callables.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from server.engine.prefix_cache import PrefixCache
from server.engine.runner import ModelRunner, PrefillCancelled
from server.engine.sampling import SampleResult, sample, scaled_log_probs, top_logprobs
from server.engine.sequence import Sequence, State

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
ABORTED_RUNNING = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}


class DuplicateRequestId(ValueError):
    pass


@dataclass
class WeightUpdate:
    """Weights ready to go in, and what to do around them."""

    tensors: dict[str, torch.Tensor]
    version: str | None
    abort_all: bool
    flush_cache: bool
    model_path: str | None = None


@dataclass
class UpdateResult:
    success: bool
    message: str


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192  # prompt tokens admitted per loop turn, so decode keeps going
    stream_interval: int = 1
    weight_version: str = "default"
    seed: int = 0
    prefix_cache_bytes: int = 0  # 0: no prefix cache
    prefix_cache_min_tokens: int = 64


class Scheduler:
    def __init__(self, runner: ModelRunner, config: SchedulerConfig) -> None:
        self.runner = runner
        self.config = config
        self.weight_version = config.weight_version
        self.model_path = runner.config.model_path
        self.paused: str | None = None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # running[i].slot == i
        self._in_flight: dict[str, Sequence] = {}
        self._in_flight_lock = threading.Lock()
        self._aborting: list[Callable[[Sequence], bool]] = []  # asked for, not yet done
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._pending_updates: deque[tuple[WeightUpdate, Future]] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        self._looping = False
        self._thread: threading.Thread | None = None
        self._generator = torch.Generator().manual_seed(config.seed)
        self._eos_ids = runner.eos_token_ids
        self.generated_tokens = 0
        self.last_gen_throughput = 0.0
        self._throughput_window: deque[tuple[float, int]] = deque(maxlen=64)
        self.prefix_cache = PrefixCache(config.prefix_cache_bytes, config.prefix_cache_min_tokens)
        self._weights_epoch = 0  # bumped at every weight load: older KV is never reused

    # ----- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Run the loop on a thread of its own (in-process use). The engine process runs it on
        its main thread instead (``run``): OpenMP kernels driven from a secondary thread ran
        about half as fast on the 2-core machine we measured."""
        self._thread = threading.Thread(target=self.run, name="proxrl-scheduler", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to finish (abort what is in flight and return); safe from any thread."""
        self._stopping = True
        self._wakeup.set()

    def stop(self) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ----- called from other threads -------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Queue a request; it is held while the engine is paused or an update is pending."""
        with self._in_flight_lock:
            if seq.rid in self._in_flight:
                raise DuplicateRequestId(f"Duplicate request ID detected: {seq.rid}")
            self._in_flight[seq.rid] = seq
        seq.version_at_submit = self.weight_version
        self.call(lambda: self.waiting.append(seq))

    def abort_soon(self, rid: str = "", abort_all: bool = False, exact: bool = False) -> Future:
        """``abort`` (``abort_exact`` when ``exact``) from any thread, as soon as it can be: a
        prefill in progress that it names stops at its next chunk (a long prompt's prefill can
        take minutes), the rest is done between two steps. The future holds how many it
        aborted."""
        if not rid and not abort_all:
            raise ValueError("abort needs rid or abort_all")

        def matches(seq: Sequence) -> bool:
            return abort_all or (seq.rid == rid if exact else seq.rid.startswith(rid))

        with self._in_flight_lock:
            self._aborting.append(matches)

        def abort() -> int:
            try:
                return self._abort_where(matches)
            finally:
                with self._in_flight_lock:
                    self._aborting.remove(matches)

        return self.call(abort)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread between two steps; its result comes in the future."""
        future: Future = Future()
        self._commands.put((fn, future))
        self._wakeup.set()
        return future

    def load(self) -> dict:
        running = sum(not s.internal for s in self.running)
        waiting = sum(not s.internal for s in self.waiting)
        return {"num_running_reqs": running, "num_waiting_reqs": waiting}

    # ----- commands (run on the scheduler thread via ``call``) -----------------------------

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort requests whose rid starts with ``rid`` (or all); they answer with their tokens."""
        if not rid and not abort_all:
            return 0
        return self._abort_where(lambda seq: abort_all or seq.rid.startswith(rid))

    def abort_exact(self, rid: str) -> int:
        """Abort the one request with this rid (a client that went away)."""
        return self._abort_where(lambda seq: seq.rid == rid)

    def _abort_where(self, matches: Callable[[Sequence], bool]) -> int:
        aborted = 0
        for seq in [s for s in self.waiting if matches(s)]:
            self.waiting.remove(seq)
            self._finish(seq, ABORTED_RUNNING if seq.ever_ran else ABORTED_WAITING)
            aborted += 1
        for seq in [s for s in self.running if matches(s)]:
            self._release(seq)
            self._finish(seq, ABORTED_RUNNING)
            aborted += 1
        return aborted

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode == "abort":
            self.abort(abort_all=True)
        elif mode == "retract":
            for seq in reversed(list(self.running)):
                self._release(seq)
                seq.state = State.WAITING
                seq.kv_len = 0
                seq.num_retractions += 1
                self.waiting.appendleft(seq)
        self.paused = mode

    def resume(self) -> None:
        self.paused = None

    def flush_cache(self) -> bool:
        """Succeeds only when nothing runs and nothing waits (waiting is ignored while paused);
        then the prefix cache is emptied, as SGLang's flush empties its radix cache."""
        idle = not self.running and (self.paused is not None or not self.waiting)
        if idle:
            self.prefix_cache.clear()
        return idle

    def set_weight_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self.abort(abort_all=True)
        self.weight_version = version

    def request_update(self, update: WeightUpdate) -> Future:
        """Apply ``update`` now if paused, else once no request is running."""
        done: Future = Future()

        def enqueue() -> None:
            if update.abort_all:
                self.abort(abort_all=True)
            self._pending_updates.append((update, done))
            self._apply_ready_updates()

        self.call(enqueue)
        return done

    # ----- the loop -------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._looping and not self._stopping

    def run(self) -> None:
        """The scheduler loop; returns after ``request_stop``."""
        self._looping = True
        try:
            self._loop()
        finally:
            self._looping = False

    @torch.inference_mode()
    def _loop(self) -> None:
        while not self._stopping:
            self._run_commands()
            self._apply_ready_updates()
            try:
                self._admit()
                if self.running and self.paused is None:
                    self._decode_step()
                    continue
            except Exception:  # keep serving: fail the batch, not the engine
                log.exception("decode step failed; aborting the running requests")
                self._fail_running("engine step failed")
            self._wakeup.wait(timeout=0.5)
            self._wakeup.clear()
        self.abort(abort_all=True)

    def _fail_running(self, message: str) -> None:
        """Finish every running request with an abort, without touching the KV cache."""
        failed, self.running = self.running, []
        for seq in failed:
            seq.state = State.WAITING  # its slot is gone; _finish must not release it
            self._finish(seq, {**ABORTED_RUNNING, "message": message})
        self.runner.cache.fit(0, 0)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _apply_ready_updates(self) -> None:
        while self._pending_updates and (self.paused is not None or not self.running):
            update, done = self._pending_updates.popleft()
            try:
                done.set_result(self._apply_update(update))
            except Exception as exc:
                done.set_exception(exc)

    def _apply_update(self, update: WeightUpdate) -> UpdateResult:
        self._weights_epoch += 1  # before the load: a load that fails halfway changed weights
        self.prefix_cache.clear()
        self.runner.load_weights(update.tensors)
        if update.version is not None:
            self.weight_version = update.version
        if update.model_path is not None:
            self.model_path = update.model_path
        message = "Succeeded to update model weights."
        # Requests waiting behind the update are held as SGLang holds them (behind its writer
        # lock, outside the scheduler), so only running ones keep the cache from flushing.
        if update.flush_cache and self.running:
            return UpdateResult(
                False,
                "Weights were updated, but the cache was not flushed because there are "
                "running or waiting requests. Pass flush_cache=false when updating in place.",
            )
        return UpdateResult(True, message)

    def _admit(self) -> None:
        if self.paused is not None or self._pending_updates:
            return
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) < self.config.max_running_requests:
            seq = self.waiting[0]
            tokens = len(seq.prompt_ids) + len(seq.output_ids)
            if tokens > budget and budget < self.config.max_prefill_tokens:
                return  # the next turn admits it, after a decode step
            self.waiting.popleft()
            budget -= tokens
            try:
                self._prefill(seq)
            except Exception as exc:
                # Stopping: an abort like any other (another engine may serve it); so is an
                # abort asked for during the prefill. A failure (out of memory, say) carries a
                # status: resubmitting it would fail again.
                reason: dict[str, Any] = {**ABORTED_RUNNING, "message": "engine stopping"}
                if isinstance(exc, PrefillCancelled) and not self._stopping:
                    reason = ABORTED_RUNNING
                elif not isinstance(exc, PrefillCancelled):
                    log.exception("prefill of %s failed", seq.rid)
                    reason = {
                        **ABORTED_RUNNING,
                        "message": f"prefill failed: {type(exc).__name__}: {exc}"[:300],
                        "status_code": 503,
                        "err_type": "ServiceUnavailable",
                    }
                if self.running and self.running[-1] is seq:  # it took the last slot
                    self.running.pop()
                seq.state = State.WAITING
                self._finish(seq, reason)

    def _prefill(self, seq: Sequence) -> None:
        first_time = not seq.ever_ran
        ids = seq.all_ids
        slot = len(self.running)
        want_input = first_time and seq.logprobs.wants_input
        prompt_logprobs = PromptLogprobs(seq) if want_input else None
        start = 0
        # A request that wants prompt logprobs needs every position's logits: no reuse.
        epoch = self._weights_epoch
        adapter = seq.adapter.uid if seq.adapter is not None else 0
        found = None if want_input else self.prefix_cache.lookup(ids, epoch, len(ids) - 1, adapter)
        if found is not None:
            entry, start = found
            self.prefix_cache.restore(self.runner.cache, slot, entry, start)
            log.debug("%s: %d of %d prompt tokens from the prefix cache", seq.rid, start, len(ids))
        seq.kv_epoch = epoch
        logits = self.runner.prefill(
            slot,
            ids,
            on_logits=prompt_logprobs.add if prompt_logprobs is not None else None,
            cancelled=lambda: self._stopping or self._abort_asked(seq),
            start=start,
            adapter=seq.adapter,
        )
        seq.slot, seq.kv_len, seq.state, seq.ever_ran = slot, len(ids), State.RUNNING, True
        self.running.append(seq)
        if prompt_logprobs is not None:
            prompt_logprobs.record()
        if len(seq.output_ids) >= seq.params.max_new_tokens:
            self._release(seq)
            self._finish(seq, {"type": "length", "length": seq.params.max_new_tokens})
            return
        self._sample_and_append([seq], logits[-1:])

    def _abort_asked(self, seq: Sequence) -> bool:
        with self._in_flight_lock:
            return any(matches(seq) for matches in self._aborting)

    def _decode_step(self) -> None:
        rows = self.running
        logits = self.runner.decode(
            [s.output_ids[-1] for s in rows],
            [s.kv_len for s in rows],
            [s.adapter for s in rows],
        )
        for seq in rows:
            seq.kv_len += 1
        self._sample_and_append(list(rows), logits)

    def _sample_and_append(self, rows: list[Sequence], logits: torch.Tensor) -> None:
        uniforms = self._uniforms(rows)
        result = sample(logits, [s.params.sampling for s in rows], uniforms)
        tokens = result.tokens.tolist()
        logprobs = result.logprobs.tolist()
        version = self.weight_version
        decode = self.runner.decode_text
        for index, seq in enumerate(rows):
            top, by_id = self._extra_logprobs(seq, result, index)
            seq.append(tokens[index], logprobs[index], version, top, by_id)
            self.generated_tokens += 1
            reason = seq.check_stop(self._eos_ids, self.runner.context_length, decode)
            if reason is not None:
                self._release(seq)
                self._finish(seq, reason)
            else:
                seq.notify(stream_interval=self.config.stream_interval)
        self._throughput_window.append((time.perf_counter(), self.generated_tokens))
        first_time, first_count = self._throughput_window[0]
        elapsed = self._throughput_window[-1][0] - first_time
        if elapsed > 0:
            self.last_gen_throughput = (self.generated_tokens - first_count) / elapsed

    def _uniforms(self, rows: list[Sequence]) -> torch.Tensor:
        draws = torch.rand(len(rows), generator=self._generator, dtype=torch.float64)
        for index, seq in enumerate(rows):
            if seq.generator is not None:
                draws[index] = torch.rand(1, generator=seq.generator, dtype=torch.float64)[0]
        return draws

    @staticmethod
    def _extra_logprobs(
        seq: Sequence, result: SampleResult, index: int
    ) -> tuple[list[tuple[float, int]] | None, list[tuple[float, int]] | None]:
        request = seq.logprobs
        if not request.enabled:
            return None, None
        row = result.log_probs[index : index + 1]
        top = top_logprobs(row, request.top_k)[0] if request.top_k > 0 else None
        by_id = None
        if request.token_ids:
            values = row[0, list(request.token_ids)].tolist()
            by_id = list(zip(values, request.token_ids, strict=True))
        return top, by_id

    # ----- slots and endings -----------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        """Give ``seq``'s KV slot back, moving the last running request into the hole; its KV
        goes into the prefix cache first when all of it came from the weights loaded now."""
        slot = seq.slot
        if slot is None or seq.state is not State.RUNNING:
            return
        if seq.kv_epoch == self._weights_epoch:
            tokens = seq.all_ids[: seq.kv_len]
            adapter = seq.adapter.uid if seq.adapter is not None else 0
            self.prefix_cache.save(self.runner.cache, slot, tokens, self._weights_epoch, adapter)
        last = self.running[-1]
        if last is not seq:
            self.runner.cache.move(len(self.running) - 1, slot, last.kv_len)
            self.running[slot] = last
            last.slot = slot
        self.running.pop()
        seq.slot = None
        self.runner.cache.fit(len(self.running), max((s.kv_len for s in self.running), default=0))

    def _finish(self, seq: Sequence, reason: dict) -> None:
        with self._in_flight_lock:
            self._in_flight.pop(seq.rid, None)
        seq.finish(reason)
        self.runner.adapters.release(seq.adapter)  # an unloaded adapter goes with its last user


class PromptLogprobs:
    """The prompt logprobs a request asked for, taken from the prefill's logits chunk by chunk
    (a ``[prompt, vocab]`` float tensor is never held whole: 40 GB for a 64k prompt and a
    152k vocabulary). Position 0 has none (``None``); they start at ``start_len``."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.picked: list[float | None] = [None]
        self.tops: list[list[tuple[float, int]] | None] = [None]
        self.by_id: list[list[tuple[float, int]] | None] = [None]

    def add(self, start: int, logits: torch.Tensor) -> None:
        """``logits[i]`` (position ``start + i``) predicts prompt token ``start + i + 1``."""
        ids = self.seq.prompt_ids
        request = self.seq.logprobs
        rows = min(len(logits), len(ids) - 1 - start)  # the prompt's last token predicts output
        if rows <= 0:
            return
        temperature = torch.tensor([self.seq.params.sampling.temperature], device=logits.device)
        # Temperature applied as for output tokens (UNVERIFIED against SGLang's input-logprob
        # path; the reference does not say).
        log_probs = scaled_log_probs(logits[:rows], temperature.expand(rows))
        targets = torch.tensor(ids[start + 1 : start + 1 + rows], device=logits.device)
        self.picked.extend(log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist())
        if request.top_k > 0:
            self.tops.extend(top_logprobs(log_probs, request.top_k))
        if request.token_ids:
            values = log_probs[:, list(request.token_ids)].tolist()
            self.by_id.extend(list(zip(r, request.token_ids, strict=True)) for r in values)

    def record(self) -> None:
        seq, request = self.seq, self.seq.logprobs
        seq.input_logprobs = self.picked[request.start_len :]
        if request.top_k > 0:
            seq.input_top = self.tops[request.start_len :]
        if request.token_ids:
            seq.input_token_ids_lp = self.by_id[request.start_len :]
