"""The deployment recipes (docs/operations/kubernetes.md, slurm.md) stay runnable as far as
this machine can tell: every YAML block parses (``yaml.safe_load_all``: a block may hold several
documents), every bash block passes ``bash -n``, and every ``proxrl`` command they write uses
flags the real command line has (the parsers ``proxrl`` builds, as the reference page reads
them) and trainer options (``key=value``) the trainer's config has. A flag renamed in the code
fails here until the recipe follows it."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.support import ROOT
from tools.docs_reference import cli
from trainer import cli as trainer_cli
from trainer.config import ConfigError, TrainConfig, load_config

PAGES = {
    "kubernetes.md": {"serve", "db upgrade", "train"},
    "slurm.md": {"serve", "db upgrade", "train"},
}
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL_OPERATORS = "();<>|&\n"


def blocks(page: str, language: str) -> list[str]:
    text = (ROOT / "docs" / "operations" / page).read_text()
    return [body for lang, body in FENCE.findall(text) if lang == language]


def shell_words(text: str) -> list[str]:
    """``text`` split as a shell would, with operators and line ends as words of their own
    (a line continued by a backslash is one line)."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=SHELL_OPERATORS)
    lexer.whitespace = " \t\r"
    lexer.whitespace_split = True
    return list(lexer)


def is_operator(word: str) -> bool:
    return bool(word) and all(c in SHELL_OPERATORS for c in word)


def subcommands() -> dict[str, set[str]]:
    """Every ``proxrl`` subcommand ("serve", "db upgrade", "train") and the flags it takes."""
    found = {}
    for command in cli.commands():
        flags = {
            name
            for flag in command.flags
            for name in flag.names.split(", ")
            if name.startswith("--")
        }
        found[command.prog.removeprefix("proxrl ")] = flags
    return found


def invocations(words: list[str], known: dict[str, set[str]]) -> Iterator[tuple[str, list[str]]]:
    """Each ``proxrl SUBCOMMAND ARGS...`` in ``words``: the subcommand and its arguments, up to
    the next shell operator. A ``proxrl`` not followed by a subcommand (a namespace, a path's
    part) is not a command."""
    for index, word in enumerate(words):
        if word != "proxrl" and not word.endswith("/proxrl"):
            continue
        rest = words[index + 1 :]
        for length in (2, 1):
            name = " ".join(rest[:length])
            if name in known:
                arguments = []
                for argument in rest[length:]:
                    if is_operator(argument):
                        break
                    arguments.append(argument)
                yield name, arguments
                break


def yaml_invocations(document: Any, known: dict[str, set[str]]) -> Iterator[tuple[str, list]]:
    """The ``proxrl`` commands of a manifest: a container's ``command`` + ``args``, and any
    string value read as a shell line (an entrypoint)."""
    if isinstance(document, dict):
        if isinstance(document.get("command"), list):
            argv = [str(a) for a in document["command"] + document.get("args", [])]
            yield from invocations([*argv, "\n"], known)
        for key, value in document.items():
            if key not in ("command", "args"):
                yield from yaml_invocations(value, known)
    elif isinstance(document, list):
        for value in document:
            yield from yaml_invocations(value, known)
    elif isinstance(document, str) and "proxrl" in document:
        yield from invocations(shell_words(document), known)


def trainer_keys(cls: type = TrainConfig, prefix: str = "") -> set[str]:
    keys = set()
    """Every option of the trainer's config, nested ones dotted (``publish.mode``)."""
    for field in dataclasses.fields(cls):
        nested = field.default_factory
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            keys |= trainer_keys(nested, f"{prefix}{field.name}.")
        else:
            keys.add(prefix + field.name)
    return keys


def problems(name: str, arguments: list[str], known: dict[str, set[str]]) -> list[str]:
    """What in one command the real parsers would refuse."""
    if name != "train":
        return [
            f"proxrl {name}: no flag {argument.split('=', 1)[0]}"
            for argument in arguments
            if argument.startswith("--") and argument.split("=", 1)[0] not in known[name]
        ]
    return train_problems(arguments)


def train_problems(arguments: list[str]) -> list[str]:
    """``proxrl train``'s flags through its own parser, then its ``key=value`` options: each key
    one the config has, and the config built from them as ``proxrl train`` builds it (values
    the shell fills in, ``$N``, stand for themselves: only their keys are checked)."""
    flags = {o for a in trainer_cli.parser()._actions for o in a.option_strings}
    found = [
        f"proxrl train: no flag {argument.split('=', 1)[0]}"
        for argument in arguments
        if argument.startswith("--") and argument.split("=", 1)[0] not in flags
    ]
    if found:
        return found
    parsed = trainer_cli.parser().parse_intermixed_args(arguments)
    keys = trainer_keys()
    overrides = []
    for option in parsed.overrides:
        key, _, value = option.partition("=")
        if key not in keys:
            found.append(f"proxrl train: no option {key!r}")
        elif "$" not in value:
            overrides.append(option)
    for flag, key in (("server", "server"), ("admin_key", "admin_key"), ("model", "model")):
        if getattr(parsed, flag) is not None:
            overrides.insert(0, f"{key}={getattr(parsed, flag)}")
    try:
        load_config(None, overrides)
    except ConfigError as exc:
        found.append(f"proxrl train: {exc}")
    return found


@pytest.fixture(scope="module")
def known() -> dict[str, set[str]]:
    return subcommands()


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_yaml_block_parses(page):
    for body in blocks(page, "yaml"):
        documents = list(yaml.safe_load_all(body))
        assert documents and all(isinstance(d, dict) for d in documents), body[:200]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_bash_block_is_valid_bash(page, tmp_path):
    for number, body in enumerate(blocks(page, "bash")):
        script = tmp_path / f"block-{number}.sh"
        script.write_text(body)
        checked = subprocess.run(
            ["bash", "-n", str(script)], capture_output=True, text=True, timeout=30
        )
        assert checked.returncode == 0, f"{page} bash block {number}: {checked.stderr}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_proxrl_command_uses_real_flags_and_options(page, known):
    commands = [
        command
        for body in blocks(page, "yaml")
        for document in yaml.safe_load_all(body)
        for command in yaml_invocations(document, known)
    ]
    commands += [c for body in blocks(page, "bash") for c in invocations(shell_words(body), known)]
    assert {name for name, _ in commands} >= PAGES[page], "a recipe lost one of its commands"
    found = [p for name, arguments in commands for p in problems(name, arguments, known)]
    assert found == []


def test_the_checks_catch_a_flag_an_option_and_a_block_that_do_not_exist(known, tmp_path):
    """The checker itself: a made-up flag, trainer option and bad value are named; a proxrl
    that is a namespace is no command; a broken YAML or bash block is refused."""
    line = (
        "kubectl -n proxrl apply -f x.yaml && proxrl serve --engines E --no-such-flag 1 | tee log\n"
        "srun -w n1 proxrl train --server=http://lb:8080 world_size=$N cluster.nosuch=1 "
        "world_size=two\n"
    )
    commands = list(invocations(shell_words(line), known))
    assert [name for name, _ in commands] == ["serve", "train"]
    assert commands[0][1] == ["--engines", "E", "--no-such-flag", "1"]
    found = [p for name, arguments in commands for p in problems(name, arguments, known)]
    assert found[0] == "proxrl serve: no flag --no-such-flag"
    assert found[1] == "proxrl train: no option 'cluster.nosuch'"
    assert "world_size" in found[2] and len(found) == 3
    manifest = {"spec": {"containers": [{"command": ["proxrl", "db", "upgrade"],
                                         "args": ["--db=x", "--nope"]}]}}  # fmt: skip
    assert [problems(n, a, known) for n, a in yaml_invocations(manifest, known)] == [
        ["proxrl db upgrade: no flag --nope"]
    ]
    with pytest.raises(yaml.YAMLError):
        list(yaml.safe_load_all("a: [1, 2\nb: 3\n"))
    script = tmp_path / "broken.sh"
    script.write_text("if true; then\n  echo unclosed\n")
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode != 0
