"""Settings of the embedded engine: ``proxrl engine --flag`` or env ``PROXRL_ENGINE_FLAG``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from server.common import admin_keys


class EngineSettings(BaseSettings):
    """Serve a Hugging Face causal LM over SGLang's native HTTP API (CPU, or CUDA when present)."""

    # An error never repeats what was given: keys are among it.
    model_config = SettingsConfigDict(
        env_prefix="PROXRL_ENGINE_", extra="forbid", hide_input_in_errors=True
    )

    model: str = Field(description="Hugging Face model directory (config, safetensors, tokenizer).")
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(30000, ge=1, le=65535, description="Port to bind.")
    served_model_name: str | None = Field(
        None, description="Model name reported by /v1/models and /model_info (default: the path)."
    )
    weight_version: str = Field("default", description="Weight version reported at start.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; auto picks CUDA when present."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and KV dtype; auto is float32 on CPU and bfloat16 on CUDA."
    )
    context_length: int | None = Field(
        None, ge=2, description="Context length (default: the model's max_position_embeddings)."
    )
    max_running_requests: int = Field(
        64, ge=1, description="Requests decoded together at most (KV slots)."
    )
    max_prefill_tokens: int = Field(
        8192, ge=1, description="Prompt tokens admitted per scheduler turn."
    )
    prefill_chunk: int = Field(
        512,
        ge=1,
        description="Prompt tokens per prefill forward: a prompt is prefilled in chunks of this "
        "many, so attention holds chunk x prompt scores, never prompt x prompt.",
    )
    prefix_cache_mb: int = Field(
        1024,
        ge=0,
        description="MiB of finished requests' KV kept (on the engine's device) for requests "
        "that extend them, least recently used evicted first; 0 turns the prefix cache off.",
    )
    prefix_cache_min_tokens: int = Field(
        64, ge=1, description="Shortest shared prefix the prefix cache reuses (tokens)."
    )
    max_loaded_loras: int = Field(
        8,
        ge=1,
        description="LoRA adapters held at once (loaded through the engine's load_lora_adapter "
        "route); a load beyond it is refused until one is unloaded. Rows of different adapters "
        "share a batch.",
    )
    stream_interval: int = Field(1, ge=1, description="Stream a chunk every N tokens.")
    incremental_streaming_output: bool = Field(
        False, description="Stream deltas instead of cumulative chunks."
    )
    api_key: str | None = Field(
        None,
        description="If set, every call needs 'Bearer <key>' (off loopback: 32+ characters, "
        "16+ of them different).",
    )
    admin_api_key: str | None = Field(
        None,
        description="If set, control calls (weights, pause, abort) need 'Bearer <key>' (off "
        "loopback: 32+ characters, 16+ of them different).",
    )
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's).")
    seed: int = Field(0, description="Seed of the sampler for requests without sampling_seed.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )

    @model_validator(mode="after")
    def _keys_are_strong(self) -> EngineSettings:
        for flag, key in (("--api-key", self.api_key), ("--admin-api-key", self.admin_api_key)):
            problem = admin_keys.problem(key, flag, self.host)
            if problem is not None:
                raise PydanticCustomError("api_key", problem)  # the message alone, no prefix
        return self

    @model_validator(mode="after")
    def _check_device(self) -> EngineSettings:
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device=cuda but CUDA is not available; use device=cpu")
        return self

    def resolved_dtype(self, device_type: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if device_type == "cuda" else "float32"


WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def model_directory_problem(model: str, loads_weights: bool = True) -> str | None:
    """What the model directory lacks, as one line that starts with ``--model MODEL``; None
    when it has it. The tokenizer (``tokenizer.json``) always; ``config.json`` and the weights
    where the model is loaded (the engine; not a proxy whose engines run elsewhere)."""
    flag = f"--model {model}"
    directory = Path(model)
    if not directory.exists():
        return f"{flag}: no such directory (make a model with `proxrl model init DIR`)"
    if not directory.is_dir():
        return f"{flag}: not a directory; give the model's folder"
    if not (directory / "tokenizer.json").is_file():
        return (
            f"{flag}: no tokenizer.json in it (the model's fast tokenizer; "
            "tokenizer.save_pretrained writes it)"
        )
    if not loads_weights:
        return None
    if not (directory / "config.json").is_file():
        return f"{flag}: no config.json in it (the engines load the model from it)"
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return f"{flag}: no weights in it (*.safetensors or *.bin)"
    return None
