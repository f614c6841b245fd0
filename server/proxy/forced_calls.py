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
request shapes: a surface says which tool (if any) is named and under which parameter, and
``forced_tool`` checks what it names against the tools the prompt shows, alike on every surface.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from server.errors import InvalidRequest
from server.proxy.reasoning import reasoning_style
from server.proxy.tool_calls import OPEN
from server.text.tokenization import Tokenizer

__all__ = ["ANY_TOOL", "forced_start", "forced_tool"]

# The tool_choice values that force a call to any of the tools (Chat's and Responses'
# "required", Anthropic's "any"); every other forcing choice names its tool.
ANY_TOOL = frozenset({"required", "any"})


def forced_tool(
    tools: Mapping[str, str], choice: str, name: object = None, param: str = "tool_choice"
) -> str | None:
    """The tool a forcing ``tool_choice`` names (None: any of them), checked against ``tools``:
    the tools the prompt shows, each name with the choice type that names it (``function``,
    Responses' ``custom``, Anthropic's ``tool``). ``choice`` is the choice's value or type as
    the request said it (``required``, ``any``, ``function``, ...), ``name`` the name it gave.
    Refused, naming ``param``: no tools to call, no name, a name not among the tools, or one
    named as another kind of tool."""
    if not tools:
        raise InvalidRequest(f"tool_choice {choice!r} needs tools to call.", param)
    if choice in ANY_TOOL:
        return None
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"tool_choice {choice!r} needs the name of a tool.", param)
    if name not in tools:
        raise InvalidRequest(
            f"tool_choice names the tool {name!r}, which is not among the tools.", param
        )
    if tools[name] != choice:
        raise InvalidRequest(
            f"tool_choice {choice!r} names the tool {name!r}, which is a {tools[name]} tool: "
            f"name it with tool_choice type {tools[name]!r}.",
            param,
        )
    return name


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
