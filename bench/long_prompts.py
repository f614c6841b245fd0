"""Long prompts: time to first token and peak memory of ``proxrl serve`` (the proxy and its
embedded engine, together) against prompt length, for one or more source trees of proxrl.

For each source tree (``--source DIR``, default this checkout; give an older checkout made with
``git worktree add`` to measure the code before a change) and each prompt length (``--lengths``,
default 8192 32768 65536 tokens), the bench starts a fresh ``proxrl serve`` from that tree on the
tiny model made with ``--context`` (default 65536; the model is made once, by this checkout),
opens a session and sends one Chat Completions request whose single user message renders, with
the chat template, to exactly that many prompt tokens, asking for one token (``max_tokens: 1``,
not streamed). It reports:

* ``ttft_s``: the request's wall time, which is the prefill plus one decode step plus the
  proxy's work on the prompt (tokenizing, rendering, recording) and HTTP: an upper bound on
  the time to the first token;
* ``peak_rss_gb``: the largest sum of the resident memory of the ``proxrl serve`` process and
  every process under it (the engine), sampled every 50 ms from before the request until the
  answer; ``hwm_gb``: the sum of each process's own peak (VmHWM) at the end, which bounds the
  first from above (the processes need not peak at once);
* ``status``: the HTTP status (200 when served), or ``capped`` when the sampled memory passed
  ``--memory-cap-gb`` and the bench stopped the server, so one run never exhausts the machine.

Ratios mean something only between rows of the same run (the machine is shared); the table in
docs/architecture/engine.md says which machine gave which numbers. ``--threads`` sets the
engine's torch threads (``PROXRL_ENGINE_NUM_THREADS``); on a loaded 2-core machine one thread
was about 7 times faster than two. Results go to stdout and to bench/results/long_prompts.json.

What it does not measure: decode speed at a long context, several long prompts at once, or the
SGLang backend.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import secrets
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import httpx  # noqa: E402

from bench.common import new_sessions, positive_int  # noqa: E402
from server.common.processes import ProxyProcess  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "long_prompts.json"
WORDS = "the answer is a number we add one two three and then tell you what it was".split()
SAMPLE_S = 0.05


@dataclass
class Row:
    source: str
    tokens: int
    prompt_tokens: int | None  # what the answer's usage says the engine read
    status: str
    ttft_s: float | None
    peak_rss_gb: float
    hwm_gb: float


def prompt_text(tokenizer, tokens: int) -> str:
    """A user message that renders (one user turn and the generation prompt) to ``tokens``
    prompt tokens: random words, then digits (one token each) to make the count exact."""
    rng = random.Random(tokens)

    def rendered(text: str) -> int:
        messages = [{"role": "user", "content": text}]
        rendering = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True
        )
        return len(rendering["input_ids"])

    overhead = rendered("")
    words = " ".join(rng.choice(WORDS) for _ in range(tokens))
    ids = tokenizer.encode(words, add_special_tokens=False)
    text = tokenizer.decode(ids[: max(0, tokens - overhead - 64)])
    while (count := rendered(text)) < tokens:
        text += "7" * (tokens - count)
    if count != tokens:
        raise RuntimeError(f"the prompt renders to {count} tokens, not {tokens}")
    return text


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def process_tree(pid: int) -> list[int]:
    children = _children()
    tree, stack = [], [pid]
    while stack:
        current = stack.pop()
        tree.append(current)
        stack.extend(children.get(current, []))
    return tree


def _status_kb(pid: int, field: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class MemoryWatch:
    """Samples the summed RSS of a process tree on a thread; over ``cap_gb`` it calls
    ``on_cap`` once (the bench stops the server)."""

    def __init__(self, pid: int, cap_gb: float, on_cap) -> None:
        self.pid, self.cap_kb, self.on_cap = pid, cap_gb * 1e6, on_cap
        self.peak_kb = 0
        self.capped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.tree = process_tree(pid)

    def _run(self) -> None:
        last_tree = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - last_tree > 1.0:
                self.tree, last_tree = process_tree(self.pid), time.monotonic()
            total = sum(_status_kb(pid, "VmRSS") for pid in self.tree)
            self.peak_kb = max(self.peak_kb, total)
            if total > self.cap_kb and not self.capped:
                self.capped = True
                self.on_cap()
            self._stop.wait(SAMPLE_S)

    def hwm_kb(self) -> int:
        return sum(_status_kb(pid, "VmHWM") for pid in process_tree(self.pid))

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def ask(session: dict, text: str, timeout: float) -> tuple[int, float, int | None]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "temperature": 1.0,
    }
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    async with httpx.AsyncClient(timeout=timeout) as http:
        started = time.perf_counter()
        reply = await http.post(
            f"{session['base_url']}/chat/completions", json=body, headers=headers
        )
        seconds = time.perf_counter() - started
        usage = reply.json().get("usage") if reply.status_code == 200 else None
        return reply.status_code, seconds, usage["prompt_tokens"] if usage else None


def measure(source: Path, model: Path, tokens: int, text: str, args) -> Row:
    os.environ["PYTHONPATH"] = str(source)  # the serve and engine processes import from it
    data = Path(tempfile.mkdtemp(prefix="proxrl-bench-long-"))
    key = secrets.token_hex(24)
    proxy = ProxyProcess(
        model,
        data,
        key,
        "--engine-max-running-requests", "8",
        "--request-timeout-s", str(args.timeout_s),
        cwd=source,
    )  # fmt: skip
    label = str(source)
    try:
        proxy.wait_ready()
        (session,) = asyncio.run(new_sessions(proxy.url, proxy.admin, 1))

        def stop_tree() -> None:
            for pid in reversed(process_tree(proxy.process.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)

        with MemoryWatch(proxy.process.pid, args.memory_cap_gb, stop_tree) as watch:
            try:
                status, seconds, prompt_tokens = asyncio.run(ask(session, text, args.timeout_s))
                outcome: str = str(status)
            except httpx.HTTPError as exc:
                outcome, seconds, prompt_tokens = type(exc).__name__, None, None  # type: ignore[assignment]
            hwm = watch.hwm_kb()
        if watch.capped:
            outcome, seconds = "capped", None  # type: ignore[assignment]
        return Row(label, tokens, prompt_tokens, outcome, seconds, watch.peak_kb / 1e6, hwm / 1e6)
    finally:
        proxy.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[8192, 32768, 65535])
    parser.add_argument("--source", type=Path, action="append", default=None)
    parser.add_argument("--context", type=positive_int, default=65536)
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--memory-cap-gb", type=float, default=12.0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args()
    sources = [s.resolve() for s in (args.source or [ROOT])]
    if args.threads:
        os.environ["PROXRL_ENGINE_NUM_THREADS"] = str(args.threads)

    from transformers import AutoTokenizer

    from server.common.tiny_model import create_tiny_model

    model = create_tiny_model(
        Path(tempfile.mkdtemp(prefix="proxrl-bench-model-")), context=args.context
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = []
    for tokens in args.lengths:
        text = prompt_text(tokenizer, tokens)
        for source in sources:
            row = measure(source, model, tokens, text, args)
            rows.append(row)
            ttft = f"{row.ttft_s:8.1f}" if row.ttft_s is not None else "       -"
            print(
                f"{row.source:<30} {row.tokens:>6} tokens ({row.prompt_tokens} read)  "
                f"status {row.status:<8} ttft_s {ttft}"
                f"  peak_rss_gb {row.peak_rss_gb:6.2f}  hwm_gb {row.hwm_gb:6.2f}",
                flush=True,
            )
    report = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "threads": args.threads,
        "memory_cap_gb": args.memory_cap_gb,
        "context": args.context,
        "rows": [asdict(row) for row in rows],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
