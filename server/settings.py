"""Settings of ``proxrl serve``: flags, or environment variables ``PROXRL_<FLAG>``."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.store.database import default_url


class ServerSettings(BaseSettings):
    """Serve a model through OpenAI's API, record every token, take rewards, publish weights."""

    model_config = SettingsConfigDict(env_prefix="PROXRL_", extra="forbid")

    model: str = Field(description="Hugging Face model directory (tokenizer, chat template).")
    served_model_name: str | None = Field(
        None, description="The model name clients use (default: the model directory's name)."
    )
    engines: str | None = Field(
        None,
        description="Comma-separated engine URLs to attach to (SGLang or `proxrl engine`); "
        "without it, proxrl starts --num-engines embedded engines.",
    )
    num_engines: int = Field(1, ge=1, description="Embedded engines to start without --engines.")
    engine_max_running_requests: int = Field(
        64, ge=1, description="Requests an embedded engine decodes together."
    )
    db: str | None = Field(
        None, description="SQLAlchemy URL of the store (default: SQLite under --data-dir)."
    )
    data_dir: Path = Field(Path("data"), description="Where the default SQLite store and logs go.")
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=1, le=65535, description="Port to bind.")
    admin_key: str | None = Field(
        None, description="Admin API key (env PROXRL_ADMIN_KEY); generated and printed if unset."
    )
    public_url: str | None = Field(
        None, description="Base URL agents reach this server at (default: http://host:port)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Longest one engine request may take."
    )
    health_interval_s: float = Field(2.0, gt=0, description="Seconds between engine checks.")
    sweep_interval_s: float = Field(
        5.0, gt=0, description="Seconds between applying session and reward deadlines."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )

    @model_validator(mode="after")
    def _no_open_server_without_a_key(self) -> ServerSettings:
        if self.admin_key is None and not _is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without an admin key: set --admin-key "
                "(or PROXRL_ADMIN_KEY), or bind 127.0.0.1"
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
        return _is_loopback(self.host)

    @property
    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
