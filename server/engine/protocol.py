"""Request shapes of SGLang 0.5.23's native API, and their validation, for the embedded engine.

See docs/architecture/sglang-protocol.md, "Error shapes". Three kinds of bad input, three error
shapes, as there:

* a known key of the wrong type, an unknown ``sampling_params`` key, malformed JSON:
  400 ``{"error": "<text>"}`` (0.5.23's generated schema check; ``error`` is a string);
* a value the engine refuses (empty ``input_ids``, negative ``max_new_tokens``, a prompt longer
  than the context, a duplicate rid, ...): 400 ``{"error": {"message": "..."}}``;
* a bad body on the other endpoints (FastAPI validation):
  400 ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``.

Unknown top-level keys of ``/generate`` are ignored, as in 0.5.23. Keys SGLang knows but this
engine cannot honour (penalties, constrained decoding, ...) are refused with a message rather
than silently dropped. ``lora_path`` names a loaded LoRA adapter (one for all, or one per
prompt, null for the base model); whether it is loaded is the service's to say. This module
knows nothing about the model or the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from server.engine.sampling import RowSampling
from server.engine.sequence import DEFAULT_MAX_NEW_TOKENS, GenerationParams, LogprobRequest

MAX_STOP_STRINGS = 32
Number = StrictInt | StrictFloat


class EngineInputError(ValueError):
    """A request the engine refuses: answered with 400 ``{"error": {"message": ...}}``."""


class SamplingParamsIn(BaseModel):
    """``sampling_params`` as 0.5.23's schema check accepts it: every key known, types strict."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: StrictInt | None = DEFAULT_MAX_NEW_TOKENS
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = -1
    min_p: Number = 0.0
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    stop_regex: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    no_stop_trim: StrictBool = False
    min_new_tokens: StrictInt = 0
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    json_schema: StrictStr | None = None
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    structural_tag: StrictStr | None = None
    stream_interval: StrictInt | None = None
    logit_bias: dict[str, Number] | None = None
    sampling_seed: StrictInt | None = None
    custom_params: dict[str, Any] | None = None
    beam_width: StrictInt | None = None
    watermark: Any = None
    choice: Any = None

    def to_params(self) -> GenerationParams:
        self._refuse_unsupported()
        max_new = DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens
        if max_new < 0:
            raise EngineInputError(f"max_new_tokens must be at least 0, got {max_new}.")
        if self.temperature < 0:
            raise EngineInputError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise EngineInputError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise EngineInputError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            raise EngineInputError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.n < 1:
            raise EngineInputError(f"n must be at least 1, got {self.n}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise EngineInputError(
                f"stream_interval must be at least 1, got {self.stream_interval}."
            )
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise EngineInputError(f"stop can hold at most {MAX_STOP_STRINGS} strings.")
        if any(s == "" for s in stops):
            raise EngineInputError("stop strings must not be empty.")
        return GenerationParams(
            max_new_tokens=max_new,
            sampling=RowSampling(
                temperature=float(self.temperature),
                top_p=float(self.top_p),
                top_k=self.top_k,
                min_p=float(self.min_p),
            ),
            stop=tuple(stops),
            stop_token_ids=frozenset(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            sampling_seed=self.sampling_seed,
            stream_interval=self.stream_interval,
        )

    def _refuse_unsupported(self) -> None:
        defaults = SamplingParamsIn()
        unsupported = (
            "stop_regex min_new_tokens frequency_penalty presence_penalty repetition_penalty "
            "json_schema regex ebnf structural_tag logit_bias custom_params beam_width "
            "watermark choice spaces_between_special_tokens"
        ).split()
        for name in unsupported:
            if getattr(self, name) != getattr(defaults, name):
                raise EngineInputError(
                    f"sampling_params.{name} is not supported by proxrl's embedded engine; "
                    "leave it at its default."
                )


class GenerateRequestIn(BaseModel):
    """The ``/generate`` body. Top-level keys this engine does not know are ignored."""

    model_config = ConfigDict(extra="ignore")

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    input_embeds: list[Any] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] | None = None
    rid: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    return_logprob: StrictBool | list[StrictBool] = False
    logprob_start_len: StrictInt | list[StrictInt] = -1
    top_logprobs_num: StrictInt | list[StrictInt] = 0
    token_ids_logprob: list[StrictInt] | list[list[StrictInt]] | None = None
    return_text_in_logprobs: StrictBool = False
    return_prompt_token_ids: StrictBool = False
    lora_path: StrictStr | list[StrictStr | None] | None = None  # adapter names, not paths
    # Known to SGLang; refused here when set (see ``_UNSUPPORTED_TOP_LEVEL``).
    session_params: Any = None
    session_id: Any = None
    return_hidden_states: Any = None
    return_routed_experts: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    custom_logit_processor: Any = None


@dataclass(frozen=True)
class GenerateItem:
    """One sample of a (possibly batched) ``/generate`` call, ready for the scheduler."""

    rid: str
    prompt_ids: list[int]
    params: GenerationParams
    logprobs: LogprobRequest
    index: int
    lora_name: str | None = None  # the LoRA adapter it asked for; None: the base model


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise EngineInputError(f"{name} has {len(value)} entries for a batch of {count}.")
        return value
    return [value] * count


def expand(
    request: GenerateRequestIn,
    encode: Any,
    vocab_size: int,
    context_length: int,
    new_rid: Any,
) -> tuple[list[GenerateItem], bool]:
    """Turn one ``/generate`` body into per-sample items; also says whether it was a batch."""
    for name in GenerateRequestIn.model_fields:
        if name in _UNSUPPORTED_TOP_LEVEL and getattr(request, name) not in (None, False):
            raise EngineInputError(f"{name} is not supported by proxrl's embedded engine.")
    prompts = _prompts(request, encode)
    batch = isinstance(request.text, list) or (
        request.input_ids is not None
        and bool(request.input_ids)
        and isinstance(request.input_ids[0], list)
    )
    count = len(prompts)
    sampling = _per_item(request.sampling_params or SamplingParamsIn(), count, "sampling_params")
    rids = request.rid if isinstance(request.rid, list) else None
    if rids is not None and len(rids) != count:
        raise EngineInputError(f"rid has {len(rids)} entries for a batch of {count}.")
    return_lp = _per_item(request.return_logprob, count, "return_logprob")
    start_len = _per_item(request.logprob_start_len, count, "logprob_start_len")
    top_num = _per_item(request.top_logprobs_num, count, "top_logprobs_num")
    token_ids = _token_ids_per_item(request.token_ids_logprob, count)
    lora_names = _per_item(request.lora_path, count, "lora_path")
    items: list[GenerateItem] = []
    for i, prompt in enumerate(prompts):
        params = sampling[i].to_params()
        _check_prompt(prompt, params, vocab_size, context_length)
        logprobs = LogprobRequest(
            enabled=return_lp[i],
            start_len=start_len[i],
            top_k=top_num[i],
            token_ids=tuple(token_ids[i]),
            with_text=request.return_text_in_logprobs,
        )
        if logprobs.enabled:
            _check_logprob_request(logprobs, len(prompt), vocab_size)
        n = sampling[i].n
        if n > 1:
            # As in SGLang, every sample of n > 1 gets a fresh rid (meta_info.id is not yours).
            sample_rids = [new_rid() for _ in range(n)]
        elif rids is not None:
            sample_rids = [rids[i]]
        elif request.rid is not None:
            sample_rids = [f"{request.rid}_{i}" if batch else request.rid]
        else:
            sample_rids = [new_rid()]
        for rid in sample_rids:
            items.append(
                GenerateItem(
                    rid=rid,
                    prompt_ids=prompt,
                    params=params,
                    logprobs=logprobs,
                    index=len(items),
                    lora_name=lora_names[i],
                )
            )
    return items, batch or len(items) > 1


def _token_ids_per_item(value: list[int] | list[list[int]] | None, count: int) -> list[list[int]]:
    if not value:
        return [[] for _ in range(count)]
    rows = [row for row in value if isinstance(row, list)]
    if len(rows) == len(value):
        return _per_item(rows, count, "token_ids_logprob")
    return [[int(t) for t in value if isinstance(t, int)]] * count


_UNSUPPORTED_TOP_LEVEL = {
    "input_embeds",
    "session_params",
    "session_id",
    "return_hidden_states",
    "return_routed_experts",
    "image_data",
    "video_data",
    "audio_data",
    "custom_logit_processor",
}


def _prompts(request: GenerateRequestIn, encode: Any) -> list[list[int]]:
    if request.input_ids is not None:
        ids = request.input_ids
        if not ids:
            raise EngineInputError("input_ids cannot be empty.")
        batch = ids if isinstance(ids[0], list) else [ids]
        if any(not row for row in batch):
            raise EngineInputError("input_ids cannot be empty.")
        return [list(row) for row in batch]
    if request.text is not None:
        texts = request.text if isinstance(request.text, list) else [request.text]
        if not texts:
            raise EngineInputError("text cannot be an empty list.")
        prompts = [encode(t) for t in texts]
        if any(not p for p in prompts):
            raise EngineInputError("text encodes to no tokens.")
        return prompts
    raise EngineInputError("Either text, input_ids or input_embeds should be provided.")


def _check_prompt(
    prompt: list[int], params: GenerationParams, vocab_size: int, context_length: int
) -> None:
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise EngineInputError(
            f"Input token id {bad[0]} is out of the vocabulary range [0, {vocab_size})."
        )
    if len(prompt) >= context_length:
        raise EngineInputError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    total = len(prompt) + params.max_new_tokens
    if total > context_length:
        raise EngineInputError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {total} tokens: {len(prompt)} "
            f"tokens from the input messages and {params.max_new_tokens} tokens for the "
            "completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )
    bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise EngineInputError(f"stop_token_ids holds {bad_stop[0]}, outside the vocabulary.")


def _check_logprob_request(request: LogprobRequest, prompt_len: int, vocab_size: int) -> None:
    if request.start_len < -1:
        raise EngineInputError(f"logprob_start_len must be -1 or more, got {request.start_len}.")
    if request.start_len >= prompt_len:
        raise EngineInputError(
            f"logprob_start_len ({request.start_len}) must be smaller than the input length "
            f"({prompt_len})."
        )
    if not 0 <= request.top_k <= vocab_size:
        raise EngineInputError(f"top_logprobs_num must be in [0, {vocab_size}].")
    if any(not 0 <= t < vocab_size for t in request.token_ids):
        raise EngineInputError("token_ids_logprob holds an id outside the vocabulary.")


# ----- bodies of the control endpoints (FastAPI-validated) ------------------------------------


class AbortRequestIn(BaseModel):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationIn(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationIn(BaseModel):
    torch_empty_cache: bool = True


class UpdateWeightsFromDiskIn(BaseModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False
    keep_pause: bool = False  # accepted; 0.5.23 does nothing with it either
    recapture_cuda_graph: bool = False
    is_async: bool = False
    token_step: int = 0
    manifest: dict | None = None


class InitWeightsUpdateGroupIn(BaseModel):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupIn(BaseModel):
    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedIn(BaseModel):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class BeginWeightUpdateIn(BaseModel):
    selector: Literal["target", "draft", "all"] = "all"


class LoadLoraAdapterIn(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False  # recorded; the embedded engine never evicts an adapter by itself


class UnloadLoraAdapterIn(BaseModel):
    lora_name: str = Field(min_length=1)


class UpdateWeightVersionIn(BaseModel):
    new_version: str
    abort_all_requests: bool = True
