"""Settings of ``proxrl serve``: flags, or environment variables ``PROXRL_<FLAG>``."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.common import admin_keys
from server.store.database import default_url
from server.store.stored_json import SERVABLE_DEPTH


def env_name(settings: type[BaseSettings], field: str) -> str:
    """The environment variable that sets ``field`` of ``settings``: its ``env_prefix`` + the
    field's name in capitals (``PROXRL_`` + ``port``: ``PROXRL_PORT``)."""
    return (settings.model_config.get("env_prefix") or "") + field.upper()


class ServerSettings(BaseSettings):
    """Serve a model through OpenAI's API, record every token, take rewards, publish weights."""

    # An error never repeats what was given: keys and database passwords are among it.
    model_config = SettingsConfigDict(
        env_prefix="PROXRL_", extra="forbid", hide_input_in_errors=True
    )

    model: str = Field(description="Hugging Face model directory (tokenizer, chat template).")
    served_model_name: str | None = Field(
        None, description="The model name clients use (default: the model directory's name)."
    )
    engines: str | None = Field(
        None,
        description="Comma-separated engine URLs to attach to (SGLang or `proxrl engine`); "
        "without it, proxrl starts --num-engines engines of the --engine kind.",
    )
    engine: Literal["embedded", "sglang"] = Field(
        "embedded",
        description="The engines proxrl starts without --engines: its embedded engine, or SGLang "
        'servers (python -m sglang.launch_server; needs CUDA and `pip install "sglang[all]"`).',
    )
    num_engines: int = Field(1, ge=1, description="Engines to start without --engines.")
    engine_max_running_requests: int = Field(
        64, ge=1, description="Requests an embedded engine decodes together."
    )
    sglang_args: str = Field(
        "",
        description="Extra flags for every SGLang server proxrl starts, one string split as a "
        'shell would, e.g. "--mem-fraction-static 0.8 --incremental-streaming-output".',
    )
    sglang_tp_size: int = Field(
        1, ge=1, description="GPUs per SGLang server (its --tp-size); server i gets the next ones."
    )
    sglang_start_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Longest an SGLang server may take to answer /health (weights, CUDA graphs).",
    )
    sglang_module: str = Field(
        "sglang.launch_server",
        description="The module proxrl runs (python -m MODULE) to start an SGLang server: "
        "a patched launcher, or a stand-in in tests.",
    )
    db: str | None = Field(
        None, description="SQLAlchemy URL of the store (default: SQLite under --data-dir)."
    )
    data_dir: Path = Field(Path("data"), description="Where the default SQLite store and logs go.")
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=1, le=65535, description="Port to bind.")
    admin_key: str | None = Field(
        None,
        description="Admin API key; generated and printed if unset on loopback. Off loopback it "
        "must be given: 32+ characters, 16+ of them different.",
    )
    dashboard_login_hours: float = Field(
        12.0, gt=0, le=24 * 365, description="How long a dashboard login lasts."
    )
    public_url: str | None = Field(
        None, description="Base URL agents reach this server at (default: http://host:port)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest one engine request may take."
    )
    max_body_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="Largest request body on the model routes (/v1/..., /sessions/{id}/v1/...), "
        "in bytes; a larger one is answered 413 before it is read whole. 32 MiB: an agent's "
        "longest prompts with their tools are a few MB.",
    )
    max_rest_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest request body on the other routes (/rl/..., /admin/...), in bytes; "
        "past it: 413, before it is read whole.",
    )
    max_json_depth: int = Field(
        64,
        ge=2,
        le=SERVABLE_DEPTH,
        description="Deepest nesting of arrays and objects a JSON body may have, on every route "
        f"(at most {SERVABLE_DEPTH}: what the answers that carry stored values can serve); "
        "deeper: 400.",
    )
    max_json_containers: int = Field(
        50_000,
        ge=1_000,
        description="Most arrays and objects a JSON body may hold (outside its strings), on "
        "every route; more: 413, before the route parses it. Validating a body holds the others "
        "for about 2 microseconds per object (a long agent session: about 12,000).",
    )
    max_metadata_bytes: int = Field(
        64 * 1024,
        ge=2,
        description="Largest session metadata, as UTF-8 JSON, in bytes; larger: 400. Every claim "
        "and session view carries it whole.",
    )
    health_interval_s: float = Field(2.0, gt=0, description="Seconds between engine checks.")
    leader_check_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Seconds between leader checks, for replicas sharing a PostgreSQL store: a "
        "follower tries to take the lead (the one replica that swaps weights and judges the "
        "engines' versions), the leader checks it still holds it. A dead leader is replaced "
        "within about this long.",
    )
    advertise_url: str | None = Field(
        None,
        description="URL the other replicas reach this one at, for the weight swaps they forward "
        "to the leader (default: http://host:port, the machine's name for 0.0.0.0 or ::).",
    )
    sweep_interval_s: float = Field(
        5.0, gt=0, description="Seconds between applying session and reward deadlines."
    )
    store_busy_timeout_s: float = Field(
        10.0,
        gt=0,
        description="How long a write waits for a SQLite store another process holds locked; "
        "past it the request is answered 503 store_unavailable with Retry-After.",
    )
    session_cache_mb: float = Field(
        256.0,
        gt=0,
        description="Memory for what the proxy keeps of each session between its turns (the "
        "last turns' tokens and text, to splice the next prompt), in MB; beyond it the least "
        "recently used sessions are dropped and reloaded from the store at their next request.",
    )
    lookup_cache_mb: float = Field(
        32.0,
        gt=0,
        description="Memory for what the proxy keeps of its store lookups (callers' keys: half; "
        "keys the store does not have: a quarter; runs' configs: a quarter), in MB; beyond it "
        "the least recently used are dropped and read from the store again when next needed.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    keep_alive_timeout_s: int = Field(
        120,
        ge=1,
        description="Seconds an idle client connection stays open. Longer than clients keep "
        "idle connections pooled (httpx and the openai SDK 5 s, aiohttp 15 s, Node 4 s, Go "
        "90 s): a server that closes first races a client reusing the connection, and that "
        "request is lost in transit. Idle connections hold no more than a descriptor: at "
        "--max-connections the longest idle are closed first.",
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description="Client connections held at once. At the cap a new connection closes the "
        "connections idle longest (kept alive between requests); with none idle its request is "
        "answered 503 with Retry-After. Lowered at start to fit the open-file limit (ulimit -n): "
        "to half of what it leaves past 64 (a connection in use may hold one to an engine).",
    )
    max_requests_admin: int = Field(
        512,
        ge=1,
        description="Requests in flight with the admin key (a script posting a batch's rewards "
        "at once: 40 sessions rewarded and ended together are 80); past it: 503, Retry-After.",
    )
    max_requests_run: int = Field(
        512, ge=1, description="Requests in flight with run keys; past it: 503, Retry-After."
    )
    max_requests_session: int = Field(
        2048,
        ge=1,
        description="Requests in flight with session keys or session paths (agents' traffic, "
        "streams until they end); past it: 503, Retry-After.",
    )
    max_requests_per_session: int = Field(
        64,
        ge=1,
        description="Requests in flight of any one session (by its key or its path); past it: "
        "503, Retry-After. An agent sends one at a time, or a few in parallel: this keeps one "
        "session from taking the whole --max-requests-session.",
    )
    max_requests_anonymous: int = Field(
        128,
        ge=1,
        description="Requests in flight without a key (dashboard pages, refused keys; health "
        "probes are never refused); past it: 503, Retry-After.",
    )
    header_timeout_s: float = Field(
        20.0,
        gt=0,
        description="Longest a request's headers may take to arrive, from its first byte (a new "
        "connection's first request: from the connection); then the connection is closed.",
    )
    body_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest a request's body may take to arrive once its headers have; then the "
        "connection is closed.",
    )
    stream_interval_ms: float = Field(
        20.0,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="The latency bound of a streamed answer: its first tokens go out at once, "
        "each later token waits at most this long for others to go out with it, in one chunk "
        "(one write; a chunk's text is the tokens' text joined), and the end goes out at once. "
        "0: every engine chunk goes out as it comes.",
    )
    weights_check_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest reading and checking a publish's weight files may take, before any "
        "engine pauses for them; past it (a hung mount) the publish is refused with a 400 "
        "weights_unreadable, and nothing paused.",
    )
    weights_pause_limit_s: float = Field(
        300.0,
        gt=0,
        description="Longest engines stay paused for a publish; a load not done by then is "
        "abandoned, the engines resume, and the publish answers 502 weights_load_timeout.",
    )
    adapters_kept: int = Field(
        4,
        ge=1,
        le=64,
        description="How many of a LoRA run's newest versions the engines keep loaded: a request "
        "that began on an older version finishes on its adapter; a publish unloads the run's "
        "versions older than these.",
    )
    pinned_adapters_per_engine: int = Field(
        2,
        ge=1,
        description="Adapters of pinned versions (a request's model@N or X-Proxrl-Version, or a "
        "production session's promoted version) outside the --adapters-kept window that each "
        "engine holds at once; loading one more first unloads the least recently used one "
        "that no request is running on. Given, it must be less than --max-loaded-loras.",
    )
    versions_kept: int = Field(
        20,
        ge=1,
        description="How many of a run's versions stay pinnable; a publish evicts the oldest "
        "beyond them (a pin to one answers 410), never the current or promoted version or 0.",
    )
    versions_max_mb: float = Field(
        0,
        ge=0,
        description="The most a run's pinnable versions' files may hold together, in MB (0: no "
        "bound); a publish evicts the oldest beyond it, as --versions-kept.",
    )
    max_loaded_loras: int = Field(
        8,
        ge=1,
        description="LoRA adapters each launched engine holds at once, of every LoRA run "
        "(embedded: past it a load is refused; SGLang: past it the least recently used one is "
        "unloaded, and reloaded when a request names it).",
    )
    lora_max_rank: int = Field(
        0,
        ge=0,
        description="Above 0: launched SGLang engines serve LoRA runs' adapters up to this rank "
        "(SGLang sizes its adapter memory for it at start). 0: they serve none. The embedded "
        "engine serves adapters of any rank without it.",
    )
    lora_target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="With --lora-max-rank: the modules (name suffixes) an adapter served on "
        "launched SGLang engines may target.",
    )
    max_loras_per_batch: int = Field(
        8,
        ge=1,
        description="With --lora-max-rank: distinct adapters in one batch of a launched SGLang "
        "engine (at most --max-loaded-loras).",
    )
    graceful_shutdown_timeout_s: int = Field(
        120,
        ge=1,
        description="On SIGTERM or Ctrl-C, how long requests in flight (streams included) may "
        "take to finish before they are cut off; no new connection is accepted meanwhile.",
    )

    @model_validator(mode="after")
    def _no_open_server_without_a_strong_key(self) -> ServerSettings:
        if self.admin_key is None and not admin_keys.is_loopback(self.host):
            raise PydanticCustomError(
                "admin_key",
                f"refusing to serve on {self.host} without an admin key: set --admin-key "
                "(or PROXRL_ADMIN_KEY), or bind 127.0.0.1; make a key with "
                f"{admin_keys.HOW_TO_MAKE_ONE}",
            )
        problem = admin_keys.problem(self.admin_key, "--admin-key (PROXRL_ADMIN_KEY)", self.host)
        if problem is not None:
            raise PydanticCustomError("admin_key", problem)  # the message alone, no prefix
        return self

    @field_validator("advertise_url")
    @classmethod
    def _advertise_url_is_http(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL (e.g. http://10.0.0.5:8000)")
        return value

    @field_validator("sglang_args")
    @classmethod
    def _sglang_args_split(cls, value: str) -> str:
        from server.engine_client.sglang import split_args

        split_args(value)
        return value

    @model_validator(mode="after")
    def _engine_flags_apply(self) -> ServerSettings:
        # A flag left at its default counts as not given (the CLI passes every field).
        fields = type(self).model_fields
        sglang_flags = (
            *("sglang_args", "sglang_tp_size", "sglang_start_timeout_s", "sglang_module"),
            *("lora_max_rank", "lora_target_modules", "max_loras_per_batch"),
        )
        given = [
            f"--{name.replace('_', '-')}"
            for name in sglang_flags
            if getattr(self, name) != fields[name].get_default(call_default_factory=True)
        ]
        if self.engines and self.engine != "embedded":
            raise ValueError(
                "--engine chooses the engines proxrl starts, and with --engines it starts none: "
                "give one of the two"
            )
        if given and (self.engines or self.engine != "sglang"):
            raise ValueError(f"{', '.join(given)} only apply with --engine sglang")
        if self.engines and self.max_loaded_loras != fields["max_loaded_loras"].default:
            raise ValueError(
                "--max-loaded-loras applies to the engines proxrl starts; engines given with "
                "--engines hold what they were started with"
            )
        pinned_given = (
            self.pinned_adapters_per_engine != fields["pinned_adapters_per_engine"].default
        )
        if pinned_given and self.pinned_adapters_per_engine >= self.max_loaded_loras:
            raise ValueError(
                f"--pinned-adapters-per-engine ({self.pinned_adapters_per_engine}) must be less "
                f"than --max-loaded-loras ({self.max_loaded_loras}): the runs' current versions "
                "need room too"
            )
        if self.lora_max_rank > 0 and self.max_loras_per_batch > self.max_loaded_loras:
            raise ValueError(  # SGLang does not start otherwise
                f"--max-loras-per-batch ({self.max_loras_per_batch}) must be at most "
                f"--max-loaded-loras ({self.max_loaded_loras})"
            )
        default_slots = fields["engine_max_running_requests"].default
        if self.engine_max_running_requests != default_slots and (
            self.engines or self.engine != "embedded"
        ):
            raise ValueError(
                "--engine-max-running-requests only applies to the embedded engines proxrl "
                'starts (for SGLang: --sglang-args "--max-running-requests N")'
            )
        return self

    @property
    def engine_urls(self) -> list[str]:
        return [u.strip().rstrip("/") for u in (self.engines or "").split(",") if u.strip()]

    @property
    def database_url(self) -> str:
        return self.db or default_url(self.data_dir)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def binds_loopback(self) -> bool:
        return admin_keys.is_loopback(self.host)

    @property
    def leader_url(self) -> str:
        """Where the other replicas reach this one (--advertise-url)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = socket.getfqdn() if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")
