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
from collections.abc import Mapping, Sequence
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

__all__ = ["TemplateError", "Tokenizer"]

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
        """The ids of ``text``, with no special tokens added around it."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

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
