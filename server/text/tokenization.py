"""A model's tokenizer and chat template, read from its Hugging Face directory without transformers.

The proxy must not import torch or transformers (transformers pulls in torch and takes seconds to
import), yet the prompts it builds must be, token for token, what ``transformers.AutoTokenizer``
builds for the engine and the trainer. Both halves rest on libraries transformers itself uses:
``tokenizers`` runs ``tokenizer.json``, and a sandboxed ``jinja2`` environment, set up the way
transformers 5 sets up its own, renders the chat template.

This module knows nothing about HTTP, sessions or sampling. Nor does it know:

- tokenizers that transformers rebuilds in Python: a ``tokenizer_class`` with its own pipeline,
  or a directory without ``tokenizer.json``. It runs ``tokenizer.json`` as saved, which is what
  transformers' generic ``TokenizersBackend`` does;
- ``apply_chat_template`` beyond rendering a string: ``continue_final_message``, assistant
  masks, ``sanitize_control_tokens``, tools given as Python functions (tools must be JSON
  schemas).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["PromptText", "TemplateError", "Tokenizer", "TooManyTokens"]

# The special tokens every transformers tokenizer names; a template sees each one that is set.
NAMED_SPECIAL_TOKENS = tuple(
    "bos_token eos_token unk_token sep_token pad_token cls_token mask_token".split()
)
# Names a message's reasoning arrives under. Templates read the first; gpt-oss reads "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' clean_up_tokenization, meant for WordPiece: drops spaces before punctuation.
CLEANUP_REPLACEMENTS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class TemplateError(ValueError):
    """The chat template refused the conversation (raise_exception in the template, or a Jinja
    error), or does not compile; the message says why."""


class TooManyTokens(ValueError):
    """A text tokenized to more ids than were allowed (``Tokenizer.encode_prompt``)."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"{tokens} tokens")
        self.tokens = tokens


@dataclass(frozen=True)
class PromptText:
    """A prompt's text and the stretches of it (``[start, end)`` character ranges, in order)
    that hold an added token's text written by the client: tokenized as text, never as the
    token (``Tokenizer.render_prompt``). The rest is the chat template's own text, whose added
    tokens (roles, turn ends, tool and reasoning markup) are the prompt's structure."""

    text: str
    as_text: tuple[tuple[int, int], ...] = ()


class Tokenizer:
    """A model directory's tokenizer and chat template, without transformers."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        eos_token_ids: frozenset[int],
        clean_up_spaces: bool = False,
    ) -> None:
        if "default" not in chat_templates:
            raise ValueError(f"no default chat template among {sorted(chat_templates)}")
        self._backend = backend
        self._clean_up_spaces = clean_up_spaces
        self._templates = {name: _compile(name, source) for name, source in chat_templates.items()}
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_templates["default"]
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        pad_token = self.special_tokens.get("pad_token")
        self.pad_token_id: int | None = (
            None if pad_token is None else backend.token_to_id(pad_token)
        )
        added = backend.get_added_tokens_decoder().values()
        self.special_texts = _longest_first(token.content for token in added if token.special)
        # The client's text is text where it would write the prompt's structure: the special
        # tokens, and the others the chat template writes (tool and reasoning markup). Other
        # added tokens are vocabulary (some tokenizers add runs of spaces for code): a client's
        # text holds them as the model was trained to read them.
        sources = list(chat_templates.values())
        self.added_texts = _longest_first(
            token.content
            for token in added
            if token.special
            or (token.content.strip() and any(token.content in source for source in sources))
        )
        self._text_backend = _text_backend(backend, set(self.added_texts))
        self._special = _alternation(self.special_texts)
        self._added = _alternation(self.added_texts)
        # No token stands for more characters than its vocabulary entry has (byte-level entries
        # spell one character per byte, SentencePiece's one per character, byte fallback's
        # <0xNN> more): a text of more characters than context * this is over the context.
        vocab = backend.get_vocab(with_added_tokens=True)
        self.max_chars_per_token = max((len(entry) for entry in vocab), default=1)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load ``model_dir`` as ``AutoTokenizer.from_pretrained`` would (local files only)."""
        directory = Path(model_dir)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: proxrl needs the model's fast tokenizer, "
                "saved as tokenizer.json (tokenizer.save_pretrained writes it)"
            )
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _tokenizer_config(directory)
        special_tokens = _special_tokens(config)
        _register_special_tokens(backend, config, special_tokens)
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        templates = _chat_templates(directory, config)
        eos_token_ids = _eos_token_ids(directory, backend, special_tokens.get("eos_token"))
        try:
            return cls(
                backend,
                special_tokens,
                templates,
                eos_token_ids,
                _cleans_up_spaces(config, backend),
            )
        except TemplateError as exc:
            raise TemplateError(f"{directory}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with no special tokens added around it. (Through the batch
        call, which releases the GIL while it works: a long text tokenized on a worker thread
        does not stop the others.)"""
        return list(self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids)

    def encode_prompt(
        self, prompt: PromptText, start: int = 0, limit: int | None = None
    ) -> list[int]:
        """The ids of ``prompt.text[start:]``: its ``as_text`` stretches tokenized as text
        (an added token's text there becomes ordinary tokens), the rest as ``encode`` does.
        The tokenizer splits text at added tokens anyway, so this is ``encode`` of the text
        but for the client's added-token texts. More than ``limit`` ids raise
        ``TooManyTokens`` before they are made Python ints (a million take 0.1 s, the GIL
        held)."""
        parsed, plain = self._encodings(prompt, start)
        count = sum(map(len, parsed)) + sum(map(len, plain))
        if limit is not None and count > limit:
            raise TooManyTokens(count)
        ids: list[int] = []
        for index, plain_encoding in enumerate(plain):
            ids += parsed[index].ids
            ids += plain_encoding.ids
        return ids + parsed[-1].ids

    def count_prompt(self, prompt: PromptText) -> int:
        """``len(encode_prompt(prompt))``, without making the ids Python ints."""
        parsed, plain = self._encodings(prompt, 0)
        return sum(map(len, parsed)) + sum(map(len, plain))

    def _encodings(
        self, prompt: PromptText, start: int
    ) -> tuple[list[tokenizers.Encoding], list[tokenizers.Encoding]]:
        """The encodings of the template's pieces of ``prompt.text[start:]`` (one more than
        the client's) and of the client's added-token texts between them."""
        cuts = [(max(begin, start), end) for begin, end in prompt.as_text if end > start]
        parsed, plain = [], []
        at = start
        for begin, end in cuts:
            parsed.append(prompt.text[at:begin])
            plain.append(prompt.text[begin:end])
            at = end
        parsed.append(prompt.text[at:])
        parsed_encodings = self._backend.encode_batch_fast(parsed, add_special_tokens=False)
        if not plain:
            return parsed_encodings, []
        return parsed_encodings, self._text_backend.encode_batch_fast(
            plain, add_special_tokens=False
        )

    def holds_added(self, text: str) -> bool:
        """Whether ``text`` holds an added token's text (special or not)."""
        return self._added is not None and self._added.search(text) is not None

    def client_text(
        self, prompt: PromptText, text: str, client_special_tokens: str = "text"
    ) -> PromptText:
        """``prompt`` followed by ``text`` (a prefill, a forced call's start), whose special
        tokens' texts stay text (``client_special_tokens`` "parse": count). Its non-special
        added tokens' texts stay tokens, a prefill's too: the callers pass either one as
        ``text``, and a forced call's start is the proxy's ``<tool_call>`` markup (only the
        tool's name in it is the client's)."""
        offset = len(prompt.text)
        found = (
            self._special.finditer(text)
            if self._special is not None and client_special_tokens == "text"
            else ()
        )
        spans = tuple((offset + match.start(), offset + match.end()) for match in found)
        return PromptText(prompt.text + text, prompt.as_text + spans)

    def render_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        client_special_tokens: str = "text",
        **template_kwargs: Any,
    ) -> PromptText:
        """``render``'s prompt, with the added tokens' texts (special or not: ``<|im_end|>``,
        ``<tool_call>``) that the client wrote in ``messages`` and ``tools`` marked to be
        tokenized as text (``client_special_tokens`` "text"; "parse": none are, as ``render`` +
        ``encode``). The prompt's structure (roles, turn ends, tool and reasoning markup) is
        then the template's alone.

        The stretches are found by rendering again with each such text wrapped in two marker
        characters that appear nowhere in the prompt; the render without the markers must be
        the prompt exactly. A template may cut client text at a non-special token (Qwen3's
        splits an answer at ``</think>``): each text whose marking breaks the render is then
        tokenized as rendered, as "parse" would, everywhere in the conversation. A template that
        cuts into a special token's text is refused with ``TemplateError``.
        """
        text = self.render(messages, tools, add_generation_prompt, **template_kwargs)
        if client_special_tokens == "parse" or not any(
            self.holds_added(value) for value in _strings([messages, tools])
        ):
            return PromptText(text)
        assert self._added is not None
        written = frozenset(
            found for value in _strings([messages, tools]) for found in self._added.findall(value)
        )
        specials = written & frozenset(self.special_texts)

        def marking(texts: frozenset[str]) -> PromptText | None:
            return self._marked_render(
                text, texts, messages, tools, add_generation_prompt, template_kwargs
            )

        prompt = marking(written)
        if prompt is None:
            # The template cuts some client text: keep as text the non-special texts whose
            # marking alone keeps the render, and the special ones (all or refused).
            kept = specials | {
                found for found in written - specials if marking(specials | {found}) is not None
            }
            prompt = marking(kept)
            if prompt is None and kept != specials:
                prompt = marking(specials)
        if prompt is None:
            raise TemplateError(
                "the conversation holds a special token's text where the chat template changes "
                "it, so it cannot be kept apart from the template's own special tokens; send it "
                "without that text (or run with client_special_tokens 'parse')"
            )
        return prompt

    def _marked_render(
        self,
        text: str,
        texts: frozenset[str],
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any],
    ) -> PromptText | None:
        """``text`` (the conversation's render) with each of ``texts`` the client wrote marked
        as text; None when the render with them marked is not ``text`` with marks around them
        (or fails: the template refuses the marks, having taken the conversation)."""
        if not texts:
            return PromptText(text)
        opening, closing = _markers(text)
        pattern = _alternation(_longest_first(texts))
        assert pattern is not None

        def mark(value: str) -> str:
            return pattern.sub(lambda match: opening + match.group() + closing, value)

        try:
            marked = self.render(
                _marked(messages, mark),
                None if tools is None else _marked(tools, mark),
                add_generation_prompt,
                **template_kwargs,
            )
        except TemplateError:
            return None
        prompt = _unmarked(marked, opening, closing, texts)
        return prompt if prompt is not None and prompt.text == text else None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``, without special tokens unless ``skip_special_tokens`` is off."""
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for old, new in CLEANUP_REPLACEMENTS:
                text = text.replace(old, new)
        return text

    def token_text(self, token_id: int) -> str:
        """The text of one token, special or not."""
        return self.decode([token_id], skip_special_tokens=False)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """The prompt ``apply_chat_template(messages, tools=tools, tokenize=False, ...)`` renders.

        ``template_kwargs`` become template variables (``documents``, ``enable_thinking``, ...);
        they override the special tokens of the same name. Raises ``TemplateError`` when the
        template refuses the conversation or fails on it.
        """
        if not messages:
            raise TemplateError("cannot render an empty conversation: send at least one message")
        use_tool_template = tools is not None and "tool_use" in self._templates
        template = self._templates["tool_use" if use_tool_template else "default"]
        variables = {
            **self.special_tokens,
            "documents": None,
            **template_kwargs,
            "messages": _template_messages(messages),
            "tools": _tool_schemas(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(variables)
        except TemplateError:
            raise
        # A template is code run on client data: whatever it raises is a refusal of that data.
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            raise TemplateError(f"the chat template failed on this conversation: {exc}") from exc


# --- Client text in a prompt ------------------------------------------------------------------

# Marker characters (Unicode's supplementary private use area) for client added-token texts.
_MARKER_CHOICES = [chr(0xF0000 + i) for i in range(64)]


def _longest_first(texts: Iterable[str]) -> tuple[str, ...]:
    """``texts`` without repeats, longest first: a regex alternation takes the first that
    matches, so a token's text is found whole, not as a shorter token inside it."""
    return tuple(sorted(set(texts), key=len))[::-1]


def _alternation(texts: Sequence[str]) -> re.Pattern[str] | None:
    """A pattern matching any of ``texts`` (None for none)."""
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def _text_backend(backend: tokenizers.Tokenizer, texts: set[str]) -> tokenizers.Tokenizer:
    """A copy of ``backend`` that reads the added tokens ``texts`` as text, for client text:
    they are marked special and special tokens are split (transformers'
    ``split_special_tokens``), which a tokenizer does to special tokens only. The pieces are
    then spelled from the model's vocabulary, and the ids decode to the text exactly."""
    saved = json.loads(backend.to_str())
    for token in saved.get("added_tokens") or []:
        if token.get("content") in texts:
            token["special"] = True
    text_backend = tokenizers.Tokenizer.from_str(json.dumps(saved))
    text_backend.encode_special_tokens = True
    return text_backend


def _strings(value: Any) -> Iterator[str]:
    """Every string in ``value`` (JSON-like data), keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            if isinstance(key, str):
                yield key
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _marked(value: Any, mark: Any) -> Any:
    """``value`` with ``mark`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return mark(value)
    if isinstance(value, Mapping):
        return {
            (mark(key) if isinstance(key, str) else key): _marked(item, mark)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [_marked(item, mark) for item in value]
    return value


def _markers(text: str) -> tuple[str, str]:
    """Two marker characters that ``text`` does not hold."""
    free = [char for char in _MARKER_CHOICES if char not in text]
    if len(free) < 2:
        raise TemplateError("the conversation holds too many private-use characters to render")
    return free[0], free[1]


def _unmarked(marked: str, opening: str, closing: str, texts: frozenset[str]) -> PromptText | None:
    """The prompt ``marked`` renders without its markers, each marked stretch (one of
    ``texts``, added tokens' texts) kept as text; None when the markers are not in pairs
    around one."""
    pieces, spans = [], []
    length = at = 0
    while (begin := marked.find(opening, at)) >= 0:
        end = marked.find(closing, begin + 1)
        inside = marked[begin + 1 : end]
        if end < 0 or inside not in texts or closing in marked[at:begin]:
            return None
        pieces += [marked[at:begin], inside]
        length += begin - at
        spans.append((length, length + len(inside)))
        length += len(inside)
        at = end + 1
    if closing in marked[at:]:
        return None
    pieces.append(marked[at:])
    return PromptText("".join(pieces), tuple(spans))


# --- Reading the model directory --------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """The object in ``path``, or an empty one when there is no such file."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} should hold a JSON object")
    return data


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    """tokenizer_config.json, with legacy special_tokens_map.json laid over it as transformers
    does when the config predates ``added_tokens_decoder``."""
    config = _read_json(directory / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:
        config.update(_read_json(directory / "special_tokens_map.json"))
    if not config.get("extra_special_tokens") and "additional_special_tokens" in config:
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    return config


def _token_content(value: Any) -> str | None:
    """A special token written as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens a template sees: the standard ones, then any other ``*_token``
    string (``image_token``, ...) and the names in a dict-valued ``extra_special_tokens``."""
    tokens = {}
    for name in NAMED_SPECIAL_TOKENS:
        if (content := _token_content(config.get(name))) is not None:
            tokens[name] = content
    for name, value in config.items():
        if name.endswith("_token") and name not in NAMED_SPECIAL_TOKENS and isinstance(value, str):
            tokens[name] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for name, value in extra.items():
            if (content := _token_content(value)) is not None:
                tokens[name] = content
    return tokens


def _register_special_tokens(
    backend: tokenizers.Tokenizer, config: Mapping[str, Any], special_tokens: Mapping[str, str]
) -> None:
    """Add the tokens tokenizer_config.json declares, as transformers does on loading: every
    entry of ``added_tokens_decoder`` (its flags win over tokenizer.json's), then each special
    token that is not yet an added token. A named special token is always special."""
    named = set(special_tokens.values())
    to_add = []
    declared = config.get("added_tokens_decoder") or {}
    for _, fields in sorted(declared.items(), key=lambda item: int(item[0])):
        fields = {key: value for key, value in fields.items() if key != "__type"}
        fields["special"] = bool(fields.get("special")) or fields["content"] in named
        to_add.append(tokenizers.AddedToken(**fields))
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    present |= {token.content for token in to_add}
    extra = config.get("extra_special_tokens")
    extra_contents = [_token_content(value) for value in extra] if isinstance(extra, list) else []
    for content in [*special_tokens.values(), *extra_contents]:
        if content is not None and content not in present:
            to_add.append(tokenizers.AddedToken(content, special=True))
            present.add(content)
    if to_add:
        backend.add_tokens(to_add)


def _token_ids(value: Any) -> list[int]:
    """An ``eos_token_id`` entry: absent, one id, or a list of ids."""
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int)]
    return []


def _eos_token_ids(
    directory: Path, backend: tokenizers.Tokenizer, eos_token: str | None
) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's eos token, and the ``eos_token_id`` of
    generation_config.json and config.json."""
    ids = set()
    if eos_token is not None and (eos_id := backend.token_to_id(eos_token)) is not None:
        ids.add(eos_id)
    for name in ("generation_config.json", "config.json"):
        ids.update(_token_ids(_read_json(directory / name).get("eos_token_id")))
    return frozenset(ids)


def _chat_templates(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates by name. Template files win over tokenizer_config.json: chat_template.jinja is
    the default, additional_chat_templates/NAME.jinja the others."""
    templates = {}
    if (default_file := directory / "chat_template.jinja").is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    for path in sorted((directory / "additional_chat_templates").glob("*.jinja")):
        templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    entry = config.get("chat_template")
    if not templates and isinstance(entry, str):
        templates["default"] = entry
    elif not templates and isinstance(entry, list):
        templates.update({item["name"]: item["template"] for item in entry})
    if "default" not in templates:
        raise ValueError(
            f"{directory} has no default chat template: expected chat_template.jinja, or a "
            "chat_template entry in tokenizer_config.json (a string, or a list with a 'default')"
        )
    return templates


def _cleans_up_spaces(config: Mapping[str, Any], backend: tokenizers.Tokenizer) -> bool:
    """Whether decode cleans up spaces: when the config asks, except on BPE models, whose text
    the cleanup would corrupt (unless the config insists)."""
    if not config.get("clean_up_tokenization_spaces", False):
        return False
    is_bpe = type(backend.model).__name__ == "BPE"
    insists = config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
    return not is_bpe or bool(insists)


# --- What a template sees ---------------------------------------------------------------------


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: keys whose value is None dropped (many
    templates print them as "None"), and reasoning under every name templates read."""
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"each message must be an object with a role, got {message!r}")
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[field] for field in REASONING_FIELDS if field in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        prepared.append(plain)
    return prepared


def _tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise TemplateError(f"each tool must be a JSON schema object, got {tool!r}")
    return [dict(tool) for tool in tools]


# --- The Jinja environment --------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``, transformers' marker of assistant text for
    training masks. Rendering a string needs no mask, so the body renders unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 types it as a plain set)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """``dict`` for templates: builds dicts but, unlike the type, leads to no Python internals."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
        )


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` for templates: refuses underscore names, the way to Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # Taking self from *args lets a template write namespace(self=...), as in Jinja.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, '), which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers 5 renders chat templates in: sandboxed (templates come from
    the Hub), blocks trimmed, ``break``/``continue``, and its filters and globals."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return environment


def _compile(name: str, source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(
            f"chat template {name!r} does not compile: {exc} (line {exc.lineno})"
        ) from exc
