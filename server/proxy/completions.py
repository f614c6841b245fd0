"""``/v1/completions``: a text or token-id prompt into a plan; the text completion's answer.

A text prompt that begins with a previous turn's exact text reuses that turn's tokens (as chat
does); a token-id prompt continues a turn when it starts with that turn's ids. A text prompt's
special tokens' texts are special tokens, whatever the run's ``client_special_tokens``: the
client writes the whole prompt, the chat template's turns and role tokens included (it is the
template here), and could send the same ids as a token-id prompt anyway. One prompt per
request: a batch of prompts is refused (each would be its own turn). Sampling, recording and
streaming are ``answer``'s; this module says what a text completion looks like.
"""

from __future__ import annotations

from typing import Any

from server.context import ServerContext
from server.engine_client.client import Piece
from server.errors import InvalidRequest
from server.proxy import outputs, prompts
from server.proxy.generation import Completion
from server.proxy.plan import (
    Plan,
    check_model,
    new_plan,
    refuse_oversize,
    run_config,
    sampling_request,
    spliced,
)
from server.proxy.recording import Served
from server.proxy.schemas import CompletionRequest
from server.proxy.session_cache import SessionState
from server.proxy.tool_calls import ContentDelta, StreamEvent


async def plan_completion(ctx: ServerContext, state: SessionState, body: CompletionRequest) -> Plan:
    config = await run_config(ctx, state)
    version = await check_model(ctx, state, body.model)
    body.refuse_untrainable()
    (given,) = _single(body)
    last = list(state.last)
    if isinstance(given, str):
        refuse_oversize(ctx, len(given), "prompt")
        prompt = await prompts.off_loop(lambda: spliced(ctx, given, last, "prompt"))
        echo = given
    else:
        if any(not 0 <= t < ctx.tokenizer.vocab_size for t in given):
            raise InvalidRequest("prompt holds a token id outside the vocabulary.", "prompt")
        prompt = prompts.from_ids(given, state.last)
        echo = ctx.tokenizer.decode(given)
    top = body.logprobs or 0
    sampling = sampling_request(ctx, prompt.ids, body.max_tokens, body, top, config)
    return new_plan(
        "cmpl",
        prompt,
        sampling,
        body.n,
        surface="completions",
        model=body.model,
        version=version,
        logprobs=body.logprobs is not None,
        echo=echo if body.echo else "",
    )


def _single(body: CompletionRequest) -> list[str | list[int]]:
    prompts_ = body.prompts()
    if len(prompts_) != 1:
        raise InvalidRequest("Send one prompt per request; batches of prompts are not supported.")
    if not prompts_[0]:
        raise InvalidRequest("prompt is empty.", param="prompt")
    return prompts_


class CompletionRenderer(outputs.OpenAIRenderer):
    """A text completion and its chunks (``answer.Renderer``). Streamed chunks carry no
    logprobs."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, ctx: ServerContext, plan: Plan, include_usage: bool) -> None:
        super().__init__(ctx.model_name, plan, include_usage)
        self.tokenizer = ctx.tokenizer

    def served(self, completion_id: str, completion: Completion) -> Served:
        text = outputs.final_text(self.tokenizer, completion)
        return Served(completion_id, completion, {"text": text}, outputs.finish_reason(completion))

    def response(self, served: list[Served], usage: dict) -> dict:
        choices = []
        for index, item in enumerate(served):
            choice: dict[str, Any] = {
                "index": index,
                "text": self.plan.echo + item.response["text"],
                "logprobs": self._logprobs(item.completion) if self.plan.logprobs else None,
                "finish_reason": item.finish_reason,
            }
            if len(served) > 1:
                choice["completion_id"] = item.completion_id
            choices.append(choice)
        return self.envelope(choices, usage)

    def _logprobs(self, completion: Completion) -> dict:
        """The ``logprobs`` object of OpenAI's (legacy) completions API."""
        tokens = [self.tokenizer.token_text(t) for t in completion.ids]
        offsets, position = [], 0
        for token in tokens:
            offsets.append(position)
            position += len(token)
        tops = completion.top or [[] for _ in completion.ids]
        return {
            "tokens": tokens,
            "token_logprobs": list(completion.logprobs),
            "top_logprobs": [{self.tokenizer.token_text(t): lp for lp, t in top} for top in tops],
            "text_offset": offsets,
        }

    def _choice(self, index: int, text: str, finish: str | None = None) -> dict:
        return self.chunk(
            [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]
        )

    def start(self) -> list[dict]:
        """With ``echo``, each choice opens with the prompt's text."""
        if not self.plan.echo:
            return []
        return [self._choice(i, self.plan.echo) for i in range(len(self.plan.completion_ids))]

    def delta(self, index: int, deltas: list[StreamEvent], piece: Piece) -> list[dict]:
        text = _text(deltas)
        return [self._choice(index, text)] if text else []

    def finish(self, index: int, deltas: list[StreamEvent], finish_reason: str) -> list[dict]:
        return [self._choice(index, _text(deltas), finish_reason)]


def _text(deltas: list[StreamEvent]) -> str:
    """The text of ``deltas`` (a text completion's are all text: its tool calls are not parsed)."""
    return "".join(delta.text for delta in deltas if isinstance(delta, ContentDelta))
