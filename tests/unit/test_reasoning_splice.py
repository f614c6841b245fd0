"""The splice rule (reasoning and special tokens the client never saw) and the reasoning split:
property tests on plain units, then the real tiny tokenizers."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.common.tiny_model import create_tiny_model
from server.proxy import prompts
from server.proxy.prompts import Kind, Unit, aligned_end, splice, units_of
from server.proxy.reasoning import (
    NO_REASONING,
    ReasoningStream,
    ReasoningStyle,
    reasoning_style,
    split_reasoning,
)
from server.proxy.session_cache import last_turn
from server.text.tokenization import Tokenizer

SPECIAL = "<s>"
SUFFIX = "<e>Q<s>next"  # what the new request adds after the history: an answer's end first

texts = st.text(alphabet="ab \n", min_size=1, max_size=6)
letters = st.text(alphabet="ab", min_size=1, max_size=4)


@st.composite
def answers(draw) -> tuple[list[Unit], str]:
    """One sampled answer's units after the generation prompt, and how a Qwen3-style template
    renders it back: reasoning kept (sent back) or dropped with all before the last
    ``</think>`` and the newlines after, special tokens the client never saw gone, the answer's
    eos token rendered as the template's own end (or not at all, when the answer ran out)."""
    units = [Unit("", Kind.START)]
    block = draw(st.sampled_from(["none", "closed", "unclosed", "stray"]))
    body = [Unit(t, Kind.TEXT) for t in draw(st.lists(texts, max_size=1))]  # one run of text
    if block == "stray":  # text up to a </think> the model wrote with no <think>
        units += [*body, Unit("</think>", Kind.CLOSE)]
    elif block != "none":
        units += [Unit("<think>", Kind.OPEN), *body]
        units += [Unit("</think>", Kind.CLOSE)] if block == "closed" else []
    kept = block == "closed" and draw(st.booleans())
    inside = "".join(unit.text for unit in body).strip()
    view = f"<think>\n{inside}\n</think>\n\n" if kept else ""  # as Qwen3 renders it back
    if block != "unclosed":
        content = draw(letters)
        special = draw(st.booleans())
        lead = "\n" * draw(st.integers(0, 2))
        units.append(Unit(lead + content[:1], Kind.TEXT))
        units += [Unit(SPECIAL, Kind.SPECIAL)] if special else []
        units += [Unit(content[1:], Kind.TEXT)] if content[1:] else []
        view += content
    ran_out = draw(st.booleans())
    units += [] if ran_out else [Unit("<e>", Kind.END)]
    return units, view


@st.composite
def turns(draw) -> tuple[list[Unit], str]:
    """A turn's units (prompts and answers) and the history as a template renders it."""
    units: list[Unit] = []
    view = ""
    count = draw(st.integers(1, 4))
    for index in range(count):
        glue = "u" + draw(letters) + "\n"
        units += [Unit(glue, Kind.TEXT), Unit(SPECIAL, Kind.SPECIAL), Unit("asst\n", Kind.TEXT)]
        answer, rendered = draw(answers())
        units += answer
        view += glue + SPECIAL + "asst\n" + rendered
        if index < count - 1:
            view += "<e>"  # the template's end of the answer; where the answer ran out, the
            if answer[-1].kind is not Kind.END:  # next prompt's tokens brought it
                units.append(Unit("<e>", Kind.END))
    return units, view


@settings(max_examples=400, deadline=None)
@given(turns())
def test_a_history_the_template_rendered_continues_the_turn(turn):
    units, view = turn
    end = aligned_end(units, view + SUFFIX, ("<e>",))
    assert end is not None
    # the new text, its answer end read as the turn's own eos token where the turn ends in one
    assert (view + SUFFIX)[end:].lstrip() in (SUFFIX, SUFFIX.removeprefix("<e>"))


@settings(max_examples=400, deadline=None)
@given(turns(), st.data())
def test_a_changed_history_never_continues_the_turn(turn, data):
    units, view = turn
    letters = [i for i, char in enumerate(view) if char in "ab"]
    if not letters:
        return
    at = data.draw(st.sampled_from(letters))
    changed = view[:at] + "Z" + view[at + 1 :]
    assert aligned_end(units, changed + SUFFIX, ("<e>",)) is None


@settings(max_examples=400, deadline=None)
@given(turns(), st.data())
def test_text_appended_to_an_answer_never_continues_the_turn(turn, data):
    units, view = turn
    text = view + SUFFIX
    ends = [i for i in range(len(text)) if text.startswith("<e>", i)]
    if units[-1].kind is not Kind.END:  # the last answer ran out: text may go on from it, as the
        ends.pop()  # plain prefix rule always allowed (a truncated answer has no end to keep)
    if not ends:
        return
    at = data.draw(st.sampled_from(ends))
    assert aligned_end(units, text[:at] + "Z" + text[at:], ("<e>",)) is None


def test_special_tokens_and_reasoning_by_example():
    units = [
        Unit("assistant\n", Kind.TEXT),
        Unit("<think>", Kind.OPEN),
        Unit("\nhm\n", Kind.TEXT),
        Unit("</think>", Kind.CLOSE),
        Unit("\n\nfi", Kind.TEXT),
        Unit("<|im_start|>", Kind.SPECIAL),
        Unit("ve", Kind.TEXT),
        Unit("<|endoftext|>", Kind.END),
    ]
    rendered = "assistant\nfive<|im_end|>\nuser"
    assert aligned_end(units, rendered) == len("assistant\nfive")
    kept = "assistant\n<think>\nhm\n</think>\n\nfive<|im_end|>"
    assert aligned_end(units, kept) == kept.index("<|im_end|>")
    assert aligned_end(units, "assistant\nfiv<|im_end|>") is None
    assert aligned_end(units, "assistant\nhm five<|im_end|>") is None
    stray = [Unit("assistant\nThe answer is 9\n", Kind.TEXT), Unit("</think>", Kind.CLOSE)]
    stray.append(Unit("\nThe answer is 7.", Kind.TEXT))
    rendered = "assistant\nThe answer is 7.<|im_end|>"
    assert aligned_end(stray, rendered) == rendered.index("<|im_end|>")
    answer = [Unit("assistant\n", Kind.TEXT), Unit("", Kind.START), Unit("1", Kind.TEXT)]
    answer += [Unit("<think>", Kind.OPEN), Unit("x", Kind.TEXT), Unit("</think>", Kind.CLOSE)]
    answer.append(Unit("\n\nThe answer is 7.", Kind.TEXT))
    assert aligned_end(answer, rendered) == rendered.index("<|im_end|>")


# --- The reasoning split --------------------------------------------------------------------

STYLES = [ReasoningStyle(True, False), ReasoningStyle(True, True), NO_REASONING]
pieces = st.sampled_from(["<think>", "</think>", "<th", "</", "\n", "\n\n", " ", "a", "b c"])


@settings(max_examples=500, deadline=None)
@given(st.lists(pieces, max_size=12), st.sampled_from(STYLES), st.data())
def test_the_stream_says_what_the_split_says_however_chunked(parts, style, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ReasoningStream(style)
    out = [part for chunk in chunks for part in stream.feed(chunk)] + stream.finish()
    reasoning, content = split_reasoning(text, style)
    assert all(piece for _, piece in out)
    assert "".join(t for kind, t in out if kind == "reasoning") == (reasoning or "")
    assert "".join(t for kind, t in out if kind == "content") == content
    kinds = [kind for kind, _ in out]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content")  # reasoning first


def test_split_reasoning_by_example():
    style = ReasoningStyle(True, False)
    assert split_reasoning("<think>\n2 + 3 = 5\n</think>\n\nFive.", style) == ("2 + 3 = 5", "Five.")
    assert split_reasoning("<think>\nrunning out", style) == ("running out", "")
    assert split_reasoning("Five.", style) == (None, "Five.")
    assert split_reasoning("x\n</think>\n\nFive.", ReasoningStyle(True, True)) == ("x", "Five.")
    assert split_reasoning("<think>a</think>b", NO_REASONING) == (None, "<think>a</think>b")


# --- The real tokenizers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def reasoning_tokenizer(tmp_path_factory) -> Tokenizer:
    path: Path = tmp_path_factory.mktemp("reasoning") / "tiny"
    return Tokenizer.from_pretrained(create_tiny_model(path, "tiny", template="reasoning"))


def test_the_reasoning_template_is_read_as_reasoning(reasoning_tokenizer, tiny_model_dir):
    assert reasoning_style(reasoning_tokenizer) == ReasoningStyle(True, False)
    assert reasoning_style(Tokenizer.from_pretrained(tiny_model_dir)) == NO_REASONING
    assert len(reasoning_tokenizer.encode("<think></think>")) == 2


def _next_prompt(tokenizer: Tokenizer, completion: str, special_inside: bool = False):
    """Turn one's prompt and completion ids, and turn two's prompt spliced from what the
    client was served (content only)."""
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt_ids = tokenizer.encode(tokenizer.render(first))
    answer = tokenizer.encode(completion)
    im_start, eos = tokenizer.encode("<|im_start|><|endoftext|>")
    if special_inside:
        answer = [*answer[:-2], im_start, *answer[-2:]]
    completion_ids = [*answer, eos]
    served = tokenizer.decode(completion_ids)
    _, content = split_reasoning(served, reasoning_style(tokenizer))
    history = [*first, {"role": "assistant", "content": content}]
    text = tokenizer.render([*history, {"role": "user", "content": "And times 4?"}])
    turn = last_turn(tokenizer, "c1", 0, prompt_ids, completion_ids)
    return turn, splice(tokenizer, text, [turn]), text


@pytest.mark.parametrize("special_inside", [False, True])
def test_the_splice_keeps_the_sampled_reasoning(reasoning_tokenizer, special_inside):
    tokenizer = reasoning_tokenizer
    completion = "<think>\n2 + 3 = 5\n</think>\n\nThe answer is 5."
    turn, prompt, text = _next_prompt(tokenizer, completion, special_inside)
    assert "<think>" not in text  # the template dropped it
    exact = turn.prompt_ids + turn.completion_ids
    assert prompt.continues is turn and prompt.ids[: len(exact)] == exact
    assert tokenizer.decode(prompt.ids[len(exact) :], skip_special_tokens=False).startswith(
        "<|im_end|>\n<|im_start|>user\nAnd times 4?"
    )


def test_the_splice_keeps_an_unclosed_block(reasoning_tokenizer):
    turn, prompt, _ = _next_prompt(reasoning_tokenizer, "<think>\n2 + 3 is")
    assert prompt.continues is turn


def test_the_splice_still_breaks_on_a_changed_answer(reasoning_tokenizer, tiny_model_dir):
    for tokenizer in (reasoning_tokenizer, Tokenizer.from_pretrained(tiny_model_dir)):
        turn, _, text = _next_prompt(tokenizer, "The answer is 5.", special_inside=True)
        edited = text.replace("answer is 5", "answer is 6")
        assert splice(tokenizer, edited, [turn]).continues is None
        appended = text.replace("answer is 5.", "answer is 5. EDITED")  # found in review
        assert splice(tokenizer, appended, [turn]).continues is None
        assert splice(tokenizer, text, [turn]).continues is turn


def test_units_split_special_tokens_and_markers(reasoning_tokenizer):
    ids = reasoning_tokenizer.encode("a<think>b</think><|im_start|>c")
    kinds = [unit.kind for unit in units_of(reasoning_tokenizer, ids)]
    assert kinds == [Kind.TEXT, Kind.OPEN, Kind.TEXT, Kind.CLOSE, Kind.SPECIAL, Kind.TEXT]
    assert (
        units_of(reasoning_tokenizer, reasoning_tokenizer.encode("<|im_end|>"))[0].kind is Kind.END
    )


def test_reasoning_sent_back_in_a_tool_loop_continues(reasoning_tokenizer):
    """After the last user message the template keeps reasoning sent back, with its own
    newlines: a block sampled without them still continues the row."""
    tokenizer = reasoning_tokenizer
    first = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt_ids = tokenizer.encode(tokenizer.render(first))
    completion_ids = tokenizer.encode("<think>2 + 3 = 5</think>Five.<|im_end|>")
    turn = last_turn(tokenizer, "c1", 0, prompt_ids, completion_ids)
    reasoning, content = split_reasoning(
        tokenizer.decode(completion_ids), reasoning_style(tokenizer)
    )
    sent_back = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    history = [*first, sent_back, {"role": "tool", "content": "5"}]
    text = tokenizer.render(history)
    assert "<think>\n2 + 3 = 5\n</think>\n\nFive." in text
    assert splice(tokenizer, text, [turn]).continues is turn
    edited = text.replace("2 + 3 = 5", "2 + 3 = 6")
    assert splice(tokenizer, edited, [turn]).continues is None


unit_kinds = st.sampled_from(list(Kind))
unit_texts = {
    Kind.TEXT: st.text(alphabet="ab \n", min_size=1, max_size=4),
    Kind.SPECIAL: st.sampled_from([SPECIAL, "<t>", "a"]),  # "a": a special text text can hold
    Kind.END: st.just("<e>"),
    Kind.START: st.just(""),
    Kind.OPEN: st.just("<think>"),
    Kind.CLOSE: st.just("</think>"),
    Kind.CALL: st.just('<tool_call>{"name": "f", "arguments": {}}</tool_call>'),
}


@st.composite
def any_units(draw) -> list[Unit]:
    kinds = draw(st.lists(unit_kinds, max_size=8))
    return [Unit(draw(unit_texts[kind]), kind) for kind in kinds]


@settings(max_examples=1500, deadline=None)
@given(any_units(), st.data())
def test_the_quick_refusal_agrees_with_every_reading(units, data):
    """``aligned_end`` refuses at once a text that the turn's first texts cannot begin
    (``_may_begin``): on any units, and texts that are their own text with special tokens left
    out and edited, it finds what trying every reading finds."""
    optional = (Kind.SPECIAL, Kind.END)
    kept = [unit.kind not in optional or data.draw(st.booleans()) for unit in units]
    whole = "".join(unit.text for unit, keep in zip(units, kept, strict=True) if keep)
    cut = data.draw(st.integers(0, len(whole)))
    edit = data.draw(st.sampled_from(["", "a", "Z", " ", "\n", SPECIAL, "<e>", "</think>"]))
    dropped = data.draw(st.integers(0, 2))
    text = whole[:cut] + edit + whole[cut + dropped :] + data.draw(st.sampled_from(["", SUFFIX]))
    for ends in ((), ("<e>",)):
        assert aligned_end(units, text, ends) == prompts._readings(units, text, ends)


def test_the_quick_refusal_keeps_every_place_a_text_may_stand():
    """A special token's text that the text also holds: the turn's first text stands both at
    the start (the special token missing) and after it; only the second reading goes on."""
    units = [Unit("a", Kind.SPECIAL), Unit("a", Kind.TEXT), Unit("b", Kind.TEXT)]
    assert aligned_end(units, "aab<e>") == prompts._readings(units, "aab<e>", ()) == 3
