"""A forced tool call: how every surface honours ``tool_choice`` that demands a call (Chat
Completions' and Responses' ``"required"`` or a named function, Anthropic's ``any`` or a named
tool).

proxrl does not constrain decoding. It starts the answer inside a call instead: the start of
one, ``<tool_call>\\n`` (then ``{"name": "<the tool>", "arguments":`` when a tool is named), is
written at the end of the prompt, after the chat template's generation prompt, and the model
writes the rest. So:

- the forced start is prompt tokens: the turn's ``prompt_ids`` end with it, it is never sampled
  and, like every prompt token, is masked out of the loss;
- every token after it is sampled from the policy as usual, with its logprob: the turn's
  completion tokens, all trained;
- the answer is read for tool calls from the forced start on (the start + the sampled text),
  so the client gets the whole call, and the stored response is what the client got.

A model may still write no call (say, no closing ``</tool_call>``): the text then stays text,
forced start included, as any malformed call does. Possible only where the model's chat template
writes calls as ``<tool_call>`` blocks (what proxrl reads back) and answers do not start inside
a ``<think>`` block; refused elsewhere, naming the parameter. This module knows no surface's
request shapes: a surface says which tool (if any) is named and under which parameter.
"""

from __future__ import annotations

import json

from server.errors import InvalidRequest
from server.proxy.reasoning import reasoning_style
from server.proxy.tool_calls import OPEN
from server.text.tokenization import Tokenizer

__all__ = ["forced_start"]


def forced_start(tokenizer: Tokenizer, name: str | None, choice: str, param: str) -> str:
    """The start of a forced call, to end the prompt with: any tool's when ``name`` is None,
    else the named tool's. ``choice`` is how the request said it (for the refusal's message)."""
    if OPEN not in tokenizer.chat_template or reasoning_style(tokenizer).starts_open:
        raise InvalidRequest(
            f"tool_choice {choice!r} cannot be honoured for this model: proxrl forces a call by "
            "starting the answer with <tool_call>, and this model's chat template does not "
            "write tool calls that way (or starts answers inside <think>). Use 'auto'.",
            param=param,
        )
    if name is None:
        return OPEN + "\n"
    # Cut before the space: tokenizers join a space to what follows, so the model writes it.
    return OPEN + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments":'
