"""``reference/config.md``: every key of the trainer's config and of a run's config.

The trainer's keys come from the frozen dataclasses of ``trainer/config.py`` (nested sections as
``section.key``, each field's help text from its metadata); a run's keys from the pydantic model
the server validates them with (``server.store.run_config.RunConfig``: its fields, and the bounds
its JSON schema states). Knows nothing of what a key does.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from server.store.run_config import RunConfig
from tools.docs_reference import markdown as md
from trainer import config as trainer_config

SOURCES = ["trainer/config.py", "server/store/run_config.py"]
_BOUNDS = {  # JSON schema keyword → how the page says it
    "exclusiveMinimum": "> {}",
    "minimum": "≥ {}",
    "exclusiveMaximum": "< {}",
    "maximum": "≤ {}",
    "minLength": "at least {} characters",
    "maxLength": "at most {} characters",
    "minItems": "at least {} items",
    "maxItems": "at most {} items",
}


@dataclasses.dataclass(frozen=True)
class Section:
    key: str  # "" for the top level, else "algorithm", "tracking.wandb"
    help: str
    rows: list[list[str]]


def trainer_sections(
    cls: type = trainer_config.TrainConfig, key: str = "", help: str = ""
) -> Iterator[Section]:
    """A section per dataclass, depth first: its own keys, then its nested sections."""
    hints = typing.get_type_hints(cls)
    rows, nested = [], []
    for field in dataclasses.fields(cls):
        name = f"{key}.{field.name}" if key else field.name
        hint = hints[field.name]
        group = trainer_config.nested_class(hint)  # a group of options (maybe an optional one)
        if group is not None:
            nested.append((group, name, field.metadata["help"]))
            continue
        default = "*secret*" if field.metadata.get("secret") else md.value(_default(field))
        rows.append([md.code(name), md.type_name(hint), default, md.text(field.metadata["help"])])
    yield Section(key, " ".join(filter(None, (help, _docstring(cls)))), rows)
    for hint, name, text in nested:
        yield from trainer_sections(hint, name, text)


def _docstring(cls: type) -> str:
    """The class's own docstring ("" for the signature dataclasses write where there is none)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def run_rows(model: type[BaseModel] = RunConfig) -> list[list[str]]:
    properties = model.model_json_schema()["properties"]
    rows = []
    for name, field in model.model_fields.items():
        rows.append(
            [
                md.code(name),
                md.type_name(field.annotation),
                md.value(field.get_default(call_default_factory=True)),
                md.text(bounds(properties[name])),
                md.text(field.description),
            ]
        )
    return rows


def bounds(schema: dict[str, Any]) -> str:
    """The bounds a JSON schema puts on a value (on any branch of a union, on list items)."""
    said = []
    for branch in schema.get("anyOf", [schema]):
        for keyword, phrase in _BOUNDS.items():
            if keyword in branch:
                said.append(phrase.format(_number(branch[keyword])))
        if "items" in branch:
            said += [f"each {b}" for b in bounds(branch["items"]).split("; ") if b != "—"]
    return "; ".join(said) or "—"


def _number(x: int | float) -> str:
    return md.number(x) if isinstance(x, float) else str(x)


def render(sections: list[Section], run: list[list[str]]) -> str:
    intro = (
        "Two configurations: the [trainer's](#trainer-config) (`proxrl train`), and a "
        "[run's](#run-config), which the server keeps and acts on."
    )
    blocks = [
        md.head("Configuration", SOURCES, intro),
        "## Trainer config",
        "`proxrl train --config run.yaml key=value ...` reads one YAML file of these keys "
        "(nested sections as mappings), then each `key=value` in order (nested keys dotted). An "
        "unknown key, a value of the wrong type or a contradiction stops it at start, naming "
        "the key. `examples/train-*.yaml` are examples.",
    ]
    for section in sections:
        if section.key:
            blocks.append(f"### `{section.key}`")
        else:
            blocks.append("### Top level")
        if section.help:
            blocks.append(md.text(section.help))
        if section.rows:
            blocks.append(md.table(["Key", "Type", "Default", "Meaning"], section.rows))
    blocks += [
        "## Run config",
        "A run's `config`: given when the run is created (`POST /rl/runs`, body "
        '`{"name", "config"}`), changed with `PATCH /rl/runs/{run_id}` (body '
        '`{"config": {...}}`, the keys to change), read back in `GET /rl/runs/{run_id}`. The '
        'server validates the keys below (strictly: `"1"` is no number, `1` no boolean) '
        "and keeps any other key as it is without acting on it (the trainer "
        "writes some of its own there). See [REST API](rest-api.md).",
        md.table(["Key", "Type", "Default", "Bounds", "Meaning"], run),
    ]
    return md.join(blocks)


def page() -> str:
    return render(list(trainer_sections()), run_rows())
