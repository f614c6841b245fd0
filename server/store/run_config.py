"""A run's configuration: sampling temperature, admission (staleness bound), reward deadlines,
groups and claims, the model names it answers to, its promotion gate.

Plain data validated by pydantic; the server and the trainer read the same fields. Keys it does
not know are kept (the trainer's own settings may live here) but never acted on by the server.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.ext.asyncio import async_sessionmaker

from server.store.byte_lru import MB, ByteLRU, nbytes

# Rewards (posted, or a run's default_reward) lie within [-REWARD_BOUND, REWARD_BOUND]: the
# trainer's statistics square returns, and a reward of 1e200 overflowed them.
REWARD_BOUND = 1e9
# Counts and durations no run reaches, so that none overflows SQL's integers or a timedelta.
MAX_COUNT = 2**31 - 1
MAX_SECONDS = 10 * 365 * 24 * 3600.0
MODEL_NAME_LENGTH = 200  # a model name's longest: requests are bounded by it, turns.model holds it
MAX_ALIASES = 64
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]


class PromotionGate(BaseModel):
    """When a LoRA run's newer version is promoted: served to its production sessions
    (``server.rl.promotion``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    margin: float = Field(
        0.0,
        allow_inf_nan=False,
        ge=-REWARD_BOUND,
        le=REWARD_BOUND,
        description="A version is promoted when its eval sessions' mean reward is at least the "
        "promoted version's mean plus this.",
    )
    min_eval_sessions: int = Field(
        8,
        ge=1,
        le=MAX_COUNT,
        description="Rewarded eval sessions a version needs before it can be promoted.",
    )


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    temperature: float = Field(
        1.0,
        gt=0,
        le=2,
        description="The sampling temperature the run trains at; requests that give no "
        "temperature are sampled at it.",
    )
    off_temperature: Literal["mask", "off_policy"] = Field(
        "mask",
        description="What the trainer does with turns sampled at another temperature: mask "
        "them out of the loss, or train them off-policy with their own behaviour logprobs.",
    )
    batch_size: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Sessions per training step; admission is off while unset.",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=MAX_COUNT,
        description="How many policy versions generation may run ahead of training (eta): "
        "the run's sessions not yet trained hold at most (max_staleness + 1) * batch_size "
        "places.",
    )
    group_size: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="Sessions per GRPO group; claims then take whole groups.",
    )
    admission_wait_s: float = Field(
        30.0,
        ge=0,
        le=MAX_SECONDS,
        allow_inf_nan=False,
        description="How long a session waits for admission before a 429.",
    )
    idle_timeout_s: Seconds | None = Field(
        600.0, description="An open session idle this long is ended (None: never)."
    )
    reward_timeout_s: Seconds | None = Field(
        600.0, description="An ended session without a reward after this is resolved."
    )
    on_missing_reward: Literal["drop", "default"] = Field(
        "drop", description="What a reward deadline does: drop the session or use default_reward."
    )
    default_reward: float = Field(
        0.0,
        allow_inf_nan=False,
        ge=-REWARD_BOUND,
        le=REWARD_BOUND,
        description="The reward on_missing_reward=default gives: a finite number within "
        f"[-{REWARD_BOUND:g}, {REWARD_BOUND:g}].",
    )
    turn_rewards_suffice: bool = Field(
        False,
        description="An ended session with per-turn rewards but no session reward is trainable "
        "(false: it waits for its session reward, or its reward deadline).",
    )
    group_timeout_s: Seconds | None = Field(
        600.0,
        description="With group_size > 1: a group whose oldest trainable session waited this "
        "long is resolved as it is, by on_incomplete_group (None: wait for the whole group).",
    )
    on_incomplete_group: Literal["train", "drop"] = Field(
        "train",
        description="What happens to a group still short of group_size at group_timeout_s, and "
        "to a session without group_id and task_id: train it as it is, or drop it.",
    )
    model_aliases: list[Annotated[str, Field(min_length=1, max_length=MODEL_NAME_LENGTH)]] = Field(
        default_factory=list,
        max_length=MAX_ALIASES,
        description="Model names GET /v1/models lists besides the served model's; with "
        "strict_model_names, the only other names a request may ask for.",
    )
    strict_model_names: bool = Field(
        False,
        description="Refuse (OpenAI's 404 model_not_found) a request for a model name other "
        "than the served model's and model_aliases (false: any name is served, and recorded).",
    )
    response_format: Literal["refuse", "unconstrained"] = Field(
        "refuse",
        description="What a request for structured output (Chat Completions' response_format, "
        "the Responses API's text.format: json_object or json_schema) gets: refuse (a 400), or "
        "unconstrained (served, sampled from the policy as any answer, so the stored logprobs "
        "stay the policy's; the answer may not be JSON or fit the schema, and carries the "
        "header X-Proxrl-Response-Format: unconstrained).",
    )
    min_trained_share: float = Field(
        0.9,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="The share of the tokens the run's sessions sampled that should train: "
        "below it (masked tokens and dropped sessions counted), the trainer logs a warning and "
        "GET /rl/runs/{id} and the dashboard show one, naming the biggest causes (0: never).",
    )
    claim_lease_s: Seconds = Field(
        300.0,
        description="How long a trainer's claim holds before its sessions return to the pool "
        "(its owner may still renew or confirm them until another claim takes them).",
    )
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNT,
        description="The most tokens any answer of the run may have, whatever a request asks "
        "(a request that asks more, or gives no limit, is cut here: finish_reason length / "
        "stop_reason max_tokens); null: up to the request's limit or the context. For agents "
        "that send no limit (the Codex CLI) or a large one (Claude Code's 32,000).",
    )
    client_special_tokens: Literal["text", "parse"] = Field(
        "text",
        description="How a special token's or the chat template's markup token's text "
        "(<|im_end|>, <|im_start|>, <tool_call>, <think>, ...) written by the client in "
        "messages, system text, instructions, tool results, tool calls' arguments or tool "
        "definitions is tokenized, on Chat Completions, Responses and Anthropic Messages: text "
        "(as ordinary text tokens, so the prompt's roles, turn ends and tool markup are only the "
        "chat template's) or parse (as the token itself: for clients that write them on "
        "purpose, who can then also write the prompt's structure). An Anthropic prefill (a "
        "final assistant message the answer continues) is the start of the model's own answer: "
        "its tool and reasoning markup stays markup, its special tokens' texts stay text. "
        "/v1/completions' text prompt, which the client formats itself, always parses them.",
    )
    hosted_tools: Literal["omit", "refuse"] = Field(
        "omit",
        description="What a Responses request's hosted tools (web_search, tool_search, "
        "file_search, ...: tools OpenAI runs, which the engine cannot) get: omit leaves them "
        "out of the prompt, counts them (proxrl_hosted_tools_omitted) and records them on the "
        "turn (sampling.omitted_tools); refuse answers 400 naming the tool.",
    )

    promotion: PromotionGate | None = Field(
        None,
        description="A promotion gate (LoRA runs only): the run's production sessions are "
        "served its promoted version, version 0 (the base) until a newer version's eval "
        "sessions number min_eval_sessions and their mean reward is at least the promoted "
        "version's plus margin; null: no gate.",
    )

    def admission_limit(self) -> int | None:
        """Places the run's training sessions may hold: (max_staleness + 1) * batch_size
        (``server.rl.admission``); None: admission is off."""
        if self.batch_size is None:
            return None
        return (self.max_staleness + 1) * self.batch_size


# How long a run's config is kept in memory: another server process on the same store sees a
# PATCH within this.
RUN_CONFIG_TTL_S = 2.0


class RunConfigs:
    """Runs' validated configs, read from the store at most every ``ttl_s`` seconds and kept in
    memory meanwhile: every request needs its run's temperature, and a read per request would
    cost. Another server on the same store sees a change within ``ttl_s``; this one at once
    (``put``)."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker,
        ttl_s: float = RUN_CONFIG_TTL_S,
        budget_bytes: int = 8 * MB,
    ) -> None:
        self.sessionmaker = sessionmaker
        self.ttl_s = ttl_s
        # run id -> (monotonic time, config); the least recently used dropped past the budget
        self._read: ByteLRU[str, tuple[float, RunConfig]] = ByteLRU(
            budget_bytes, size_of=lambda entry: nbytes(entry[1].model_dump())
        )

    async def get(self, run_id: str) -> RunConfig | None:
        """The run's config, or None for no such run."""
        cached = self._read.get(run_id)
        if cached is not None and time.monotonic() - cached[0] < self.ttl_s:
            return cached[1]
        from server.store.runs import get_run  # runs' writes validate with this module

        read_at = time.monotonic()
        async with self.sessionmaker() as db:
            run = await get_run(db, run_id)
        if run is None:
            return None
        config = RunConfig.model_validate(run.config)
        self._read.put(run_id, (read_at, config))
        return config

    def put(self, run_id: str, config: RunConfig) -> None:
        self._read.put(run_id, (time.monotonic(), config))
