"""The tiny model: an ordinary Hugging Face directory, built offline and deterministically."""

from __future__ import annotations

import hashlib
import json

import pytest
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.common.tiny_model import (
    IM_END,
    MARKUP_TOKENS,
    PAD_TOKEN,
    create_tiny_model,
    set_context,
)

SAMPLES = [
    "What is 123 + 456? The answer is 579.",
    "héllo ünïcode 日本語 🎉 — naïve café",
    "  leading spaces\t\ttabs\n\nand newlines\r\n",
    '<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{"name": "calculator"}\n</tool_call>',
    "'s 're 've CAPITALS MiXeD 0.5e-3 -42",
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_autotokenizer_keeps_the_saved_pipeline(tiny_model_dir, tokenizer):
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    assert type(tokenizer).__name__ == "TokenizersBackend"
    assert tokenizer.backend_tokenizer.normalizer is None
    assert str(tokenizer.backend_tokenizer.pre_tokenizer) == str(raw.pre_tokenizer)
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == text


def test_ids_round_trip_through_text(tokenizer):
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer.encode("90210", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == list("90210")


def test_special_and_markup_tokens(tokenizer):
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == PAD_TOKEN
    for token in [IM_END, "<|im_start|>", *MARKUP_TOKENS]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    call = tokenizer.encode("<tool_call>x</tool_call><|im_end|>", add_special_tokens=False)
    # Tool markup survives skip_special_tokens (the tool-call parser needs it); <|im_end|> not.
    assert tokenizer.decode(call, skip_special_tokens=True) == "<tool_call>x</tool_call>"


def test_chat_template_renders_every_role_and_tool_calls(tokenizer):
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "2+2"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is 4."}]},
    ]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    text = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nYou add numbers.\n\n# Tools\n")
    assert json.dumps(tools[0]) in text
    assert (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n4\n</tool_response>\n"
        "<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 4.<|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_without_tools_or_system(tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"


def test_tool_call_arguments_as_a_mapping(tokenizer):
    call = {"function": {"name": "f", "arguments": {"x": 1}}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>' in text


def _digest(directory) -> dict[str, str]:
    return {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in ("tokenizer.json", "model.safetensors", "config.json")
    }


def test_building_twice_gives_the_same_files(tiny_model_dir, tmp_path):
    again = create_tiny_model(tmp_path / "again", "tiny")
    assert _digest(again) == _digest(tiny_model_dir)


@pytest.mark.parametrize(("size", "low", "high"), [("tiny", 1e6, 2e6), ("small", 5e6, 25e6)])
def test_parameter_counts(size, low, high, tiny_model_dir, tmp_path):
    directory = tiny_model_dir if size == "tiny" else create_tiny_model(tmp_path / size, size)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert low <= sum(p.numel() for p in model.parameters()) <= high
    assert type(model).__name__ == "LlamaForCausalLM"


def test_unknown_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown size"):
        create_tiny_model(tmp_path / "x", "huge")


def test_context_sets_the_positions_and_nothing_else(tiny_model_dir, tmp_path):
    longer = create_tiny_model(tmp_path / "long", "tiny", context=65536)
    config = json.loads((longer / "config.json").read_text())
    assert config["max_position_embeddings"] == 65536
    assert AutoTokenizer.from_pretrained(longer).model_max_length == 65536
    assert (longer / "model.safetensors").read_bytes() == (
        tiny_model_dir / "model.safetensors"
    ).read_bytes()
    again = create_tiny_model(tmp_path / "again", "tiny", context=65536)
    assert _digest(again) == _digest(longer)


def test_set_context_rewrites_a_model_directory(tmp_path):
    directory = create_tiny_model(tmp_path / "m", "tiny")
    set_context(directory, 8192)
    assert AutoTokenizer.from_pretrained(directory).model_max_length == 8192
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.config.max_position_embeddings == 8192
    assert _digest(directory) == _digest(create_tiny_model(tmp_path / "fresh", context=8192))


@pytest.mark.parametrize("context", [0, 127, (1 << 20) + 1])
def test_a_context_out_of_range_is_refused(context, tmp_path):
    with pytest.raises(ValueError, match="not between 128 and 1048576"):
        create_tiny_model(tmp_path / "x", "tiny", context=context)
    with pytest.raises(ValueError, match="not between"):
        set_context(tmp_path / "x", context)
