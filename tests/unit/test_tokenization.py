"""server.text.tokenization against transformers: same ids, same text, same rendered prompts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
import tokenizers
from transformers import AutoTokenizer

from server.text.tokenization import TemplateError, Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
]

TEXTS = [
    "",
    "What is 123 + 456? The answer is 579.",
    "héllo ünïcode 日本語 🎉 — naïve café, 👩‍👩‍👧 ẞ",
    "  leading spaces\t\ttabs\n\nand newlines\r\n   ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>',
    "<tool_response>\n4\n</tool_response><|endoftext|>",
    "<|im_end|><|im_end|>x<|im_start|><tool_call></tool_call>",
    "'s 're 've n't CAPITALS MiXeD 0.5e-3 -42 don't",
    "\x00 control \x7f chars \u200b zero width",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city — «café» <b>&</b>",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
TOOLS = [WEATHER_TOOL, CALCULATOR_TOOL]


def _tool_call(name: str, arguments: str | dict) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "user only": [{"role": "user", "content": "What is 2 + 2?"}],
    "system, user, assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi 👋"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye.\n\n  "},
    ],
    "tool call, arguments as a JSON string": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_tool_call("get_weather", '{"city": "Paris"}')],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    ],
    "tool call, arguments as a dict": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "12 * 7?"},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [_tool_call("calculator", {"expression": "12 * 7", "ünï": [1, 2.5]})],
        },
        {"role": "tool", "content": "84"},
        {"role": "assistant", "content": "84."},
    ],
    "two calls, consecutive tool messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "tool_calls": [
                _tool_call("get_weather", {"city": "Paris"}),
                _tool_call("get_weather", {"city": "Rome"}),
            ],
        },
        {"role": "tool", "content": "18°C"},
        {"role": "tool", "content": "25°C"},
        {"role": "assistant", "content": "Paris 18°C, Rome 25°C."},
    ],
    "content as text parts": [
        {"role": "system", "content": [{"type": "text", "text": "Be kind."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "tool", "content": [{"type": "text", "text": "tool text"}]},
    ],
    "conversation ending with a tool message": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [_tool_call("calculator", '{"expression": "1"}')]},
        {"role": "tool", "content": "1"},
    ],
}

# Exercises what the tiny model's template does not: raise_exception, tojson arguments,
# namespace(), loop variables, break/continue, dict(), {% generation %}, strftime_now and the
# special-token variables.
FEATURE_TEMPLATE = """\
{%- if messages[0].role not in ['system', 'user'] %}
    {{- raise_exception('Conversations must start with a system or user message, not '
                        + messages[0].role) }}
{%- endif %}
{%- if strftime_now('%Y-%m-%d') | length != 10 %}
    {{- raise_exception('strftime_now is missing') }}
{%- endif %}
{{- bos_token if bos_token is defined else '[no bos]' }}
year={{ strftime_now('%Y') }}
{%- set ns = namespace(last_user=-1, stopped=false) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- if tools %}
<tools>
{{ tools | tojson(indent=2) }}
</tools>
{% endif %}
{%- set meta = dict(count=messages | length, first=messages[0].role) %}
meta={{ meta | tojson(sort_keys=true, separators=(',', ':')) }}
{% for message in messages %}
    {%- if message.role == 'stop' %}{% set ns.stopped = true %}{% break %}{% endif %}
    {%- if message.role == 'skip' %}{% continue %}{% endif %}
<{{ message.role }}{{ ' last' if loop.last }}{{ ' latest-user' if loop.index0 == ns.last_user }}>
{% if message.role == 'assistant' %}{% generation %}{{ message.content | trim }}{% endgeneration %}
{%- else %}{{ message.content | trim }}{% endif %}
{% if message.tool_calls is defined %}
{{ message.tool_calls | tojson }}
{% endif %}
{{ eos_token }}
{% endfor %}
{%- if ns.stopped %}[stopped]{% endif %}
{%- if extra_note is defined %}note={{ extra_note }}{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}
"""

FEATURE_CONVERSATIONS = {
    "plain": [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "hello"}],
    "latest user and loop.last": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": "three"},
    ],
    "continue and break": [
        {"role": "user", "content": "kept"},
        {"role": "skip", "content": "skipped"},
        {"role": "assistant", "content": "kept too"},
        {"role": "stop", "content": ""},
        {"role": "user", "content": "never rendered"},
    ],
    "tool calls through tojson": [
        {"role": "user", "content": "calc"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [_tool_call("calculator", {"expression": "«1 + 1»"})],
        },
    ],
}


def _copy_tokenizer(source: Path, destination: Path) -> Path:
    destination.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, destination / name)
    return destination


@pytest.fixture(scope="module")
def ours(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def theirs(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def feature_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = _copy_tokenizer(tiny_model_dir, tmp_path_factory.mktemp("feature") / "model")
    (directory / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    return directory


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_match_transformers(ours: Tokenizer, theirs, text: str) -> None:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip
        )


def test_special_tokens_encode_whole_and_decode_as_transformers(ours: Tokenizer, theirs) -> None:
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>"]:
        assert ours.encode(token) == [theirs.convert_tokens_to_ids(token)]
    ids = ours.encode("<tool_call>x</tool_call><|im_end|>")
    # Tool markup is not special: it survives skip_special_tokens, <|im_end|> does not.
    assert ours.decode(ids) == "<tool_call>x</tool_call>"
    assert ours.decode(ids, skip_special_tokens=False) == "<tool_call>x</tool_call><|im_end|>"


def test_token_text_of_every_token(ours: Tokenizer, theirs) -> None:
    for token_id in range(ours.vocab_size):
        assert ours.token_text(token_id) == theirs.decode([token_id], skip_special_tokens=False)


def test_vocabulary_and_token_ids(ours: Tokenizer, theirs, tiny_model_dir: Path) -> None:
    assert ours.vocab_size == len(theirs)
    assert ours.pad_token_id == theirs.pad_token_id
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert ours.eos_token_ids == {theirs.eos_token_id, *generation["eos_token_id"]}
    assert ours.eos_token_ids == {
        theirs.convert_tokens_to_ids("<|im_end|>"),
        theirs.convert_tokens_to_ids("<|endoftext|>"),
    }
    assert ours.chat_template == theirs.chat_template


def test_eos_ids_are_the_union_of_the_three_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = _copy_tokenizer(tiny_model_dir, tmp_path / "model")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "eos_token_id": [5, 2]}))
    assert Tokenizer.from_pretrained(directory).eos_token_ids == {2, 5, 7}
    (directory / "generation_config.json").unlink()
    (directory / "config.json").unlink()
    assert Tokenizer.from_pretrained(directory).eos_token_ids == {2}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True], ids=["no tools", "tools"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_render_matches_apply_chat_template(
    ours: Tokenizer, theirs, name: str, with_tools: bool, add_generation_prompt: bool
) -> None:
    messages, tools = CONVERSATIONS[name], TOOLS if with_tools else None
    expected = theirs.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    rendered = ours.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ours.encode(rendered) == theirs.encode(rendered, add_special_tokens=False)


def test_render_leaves_the_callers_messages_alone(ours: Tokenizer) -> None:
    messages = json.loads(json.dumps(CONVERSATIONS["two calls, consecutive tool messages"]))
    before = json.dumps(messages)
    ours.render(messages, tools=TOOLS)
    assert json.dumps(messages) == before


def test_render_refuses_what_the_template_cannot_render(ours: Tokenizer, theirs) -> None:
    with pytest.raises(TemplateError, match="empty conversation"):
        ours.render([])
    # A tool call without a name: the template adds an undefined value to a string.
    nameless = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
    ]
    with pytest.raises(jinja2.TemplateError):
        theirs.apply_chat_template(nameless, tokenize=False)
    with pytest.raises(TemplateError, match="chat template failed"):
        ours.render(nameless)
    with pytest.raises(TemplateError, match="JSON schema"):
        ours.render(nameless[:1], tools=["get_weather"])  # type: ignore[list-item]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True], ids=["no tools", "tools"])
@pytest.mark.parametrize("name", list(FEATURE_CONVERSATIONS))
def test_feature_template_matches_apply_chat_template(
    feature_model_dir: Path, name: str, with_tools: bool, add_generation_prompt: bool
) -> None:
    ours = Tokenizer.from_pretrained(feature_model_dir)
    theirs = AutoTokenizer.from_pretrained(feature_model_dir)
    messages, tools = FEATURE_CONVERSATIONS[name], TOOLS if with_tools else None
    kwargs = {"add_generation_prompt": add_generation_prompt, "extra_note": "n°1"}
    expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
    rendered = ours.render(messages, tools=tools, **kwargs)
    assert rendered == expected
    assert f"year={datetime.now().year}" in rendered
    assert "[no bos]" in rendered and "<|im_end|>" in rendered


def test_feature_template_renders_what_it_promises(feature_model_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(feature_model_dir)
    rendered = ours.render(FEATURE_CONVERSATIONS["continue and break"], tools=[WEATHER_TOOL])
    assert "skipped" not in rendered and "never rendered" not in rendered
    assert rendered.endswith("[stopped]<assistant>")
    assert '\n  {\n    "type": "function"' in rendered  # tojson(indent=2)
    assert "«café» <b>&</b>" in rendered  # tojson keeps non-ASCII and HTML characters
    assert 'meta={"count":5,"first":"user"}' in rendered


def test_raise_exception_becomes_template_error(feature_model_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(feature_model_dir)
    theirs = AutoTokenizer.from_pretrained(feature_model_dir)
    messages = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(jinja2.TemplateError) as their_error:
        theirs.apply_chat_template(messages, tokenize=False)
    with pytest.raises(TemplateError) as our_error:
        ours.render(messages)
    assert str(our_error.value) == str(their_error.value)
    assert (
        str(our_error.value)
        == "Conversations must start with a system or user message, not assistant"
    )


def test_templates_in_tokenizer_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A list of named templates in tokenizer_config.json: "tool_use" when tools are given."""
    directory = _copy_tokenizer(tiny_model_dir, tmp_path / "model")
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | tojson }}|{{ messages[-1].content }}"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    messages = CONVERSATIONS["system, user, assistant"]
    for tools in (None, TOOLS, []):
        expected = theirs.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ours.render(messages, tools=tools) == expected
    assert ours.chat_template == config["chat_template"][0]["template"]


def test_template_string_in_tokenizer_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    directory = _copy_tokenizer(tiny_model_dir, tmp_path / "model")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ eos_token }}{{ messages | length }}{{ pad_token }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    # chat_template.jinja wins over the config's entry ...
    assert (
        Tokenizer.from_pretrained(directory).chat_template
        == (tiny_model_dir / "chat_template.jinja").read_text()
    )
    # ... which is used when there is no such file.
    (directory / "chat_template.jinja").unlink()
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        CONVERSATIONS["user only"], tokenize=False
    )
    assert Tokenizer.from_pretrained(directory).render(CONVERSATIONS["user only"]) == expected
    assert expected == "<|im_end|>1<|endoftext|>"


def test_tokens_declared_only_in_tokenizer_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Special tokens missing from tokenizer.json are added, ``added_tokens_decoder`` flags win,
    model-specific ``*_token`` names reach the template, and decode cleans up spaces on request."""
    directory = _copy_tokenizer(tiny_model_dir, tmp_path / "model")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(
        bos_token="<s>",
        unk_token={"__type": "AddedToken", "content": "<unk>", "lstrip": False},
        image_token="<image>",
        extra_special_tokens=["<extra>"],
        added_tokens_decoder={
            "684": {"content": "<tool_call>", "special": True, "normalized": False},
        },
        clean_up_tokenization_spaces=True,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True,
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(
        "{{ bos_token }}|{{ image_token }}|{{ unk_token }}|{{ messages[0] | tojson }}"
    )
    ours, theirs = Tokenizer.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.vocab_size == len(theirs) == len(AutoTokenizer.from_pretrained(tiny_model_dir)) + 4
    text = "<s>a <image> b <unk><extra> <tool_call>x</tool_call> don 't , ok ."
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids).endswith(" x</tool_call> don 't, ok.")  # special, cleaned up
    # Reasoning under an older name reaches the template under every name; None values vanish.
    messages = [{"role": "user", "content": "hi", "reasoning": "why", "name": None}]
    expected = theirs.apply_chat_template(messages, tokenize=False)
    assert ours.render(messages) == expected
    assert '"reasoning_content": "why"' in expected and expected.startswith("<s>|<image>|<unk>|")


def test_missing_files_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)
    directory = _copy_tokenizer(tiny_model_dir, tmp_path / "model")
    (directory / "chat_template.jinja").unlink()
    with pytest.raises(
        ValueError, match=r"no default chat template: expected chat_template\.jinja"
    ):
        Tokenizer.from_pretrained(directory)
    (directory / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(TemplateError, match="does not compile"):
        Tokenizer.from_pretrained(directory)


def test_importing_it_loads_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, server.text.tokenization; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.parametrize(
    "template",
    [
        "{% set ns = namespace(_secret=1) %}",
        "{% set ns = namespace(a=1) %}{% set ns._secret = 2 %}",
        "{{ dict.mro() }}",
        "{{ messages.append(messages[0]) }}",
    ],
)
def test_templates_stay_in_the_sandbox(tiny_model_dir: Path, template: str) -> None:
    backend = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tokenizer = Tokenizer(backend, {}, {"default": template}, frozenset())
    with pytest.raises(TemplateError):
        tokenizer.render(CONVERSATIONS["user only"])
