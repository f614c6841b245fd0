"""The trainer's config: YAML + overrides, every field documented, bad values named at start."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest

from tests.support import ROOT
from trainer.config import ConfigError, TrainConfig, describe, load_config, to_dict

BASE = ["server=http://127.0.0.1:9"]


def test_yaml_then_overrides_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batch_size: 16\nalgorithm:\n  eps_clip: 0.3\n  advantage: rloo\nlr: 1e-4\n")
    config = load_config(path, [*BASE, "algorithm.eps_clip=0.25", "max_staleness=4"])
    assert config.batch_size == 16
    assert config.lr == pytest.approx(1e-4)
    assert config.algorithm.eps_clip == 0.25 and config.algorithm.advantage == "rloo"
    assert config.max_staleness == 4
    assert config.algorithm.discount == 1.0  # untouched defaults stay


def test_the_required_names_exist():
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {"batch_size", "max_steps", "max_staleness", "world_size", "lr", "run_id"} <= names


def _all_fields(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        present = [a for a in typing.get_args(hint) if a is not type(None)]
        group = present[0] if len(present) == 1 else hint  # a group of options that may be absent
        if dataclasses.is_dataclass(group):
            yield from _all_fields(group, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def test_every_field_has_help_and_is_listed():
    listing = "\n".join(describe())
    for name, f in _all_fields(TrainConfig):
        assert len(f.metadata.get("help", "")) > 10, name
        assert f"  {name} (" in listing, name


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["batch_size=0"], "batch_size"),
        (["lr=-1"], "lr"),
        (["lr=fast"], "lr"),
        (["world_size=two"], "world_size"),
        (["max_staleness=-1"], "max_staleness"),
        (["algorithm.advantage=ppo2"], "algorithm.advantage"),
        (["algorithm.eps_clip_hi=0.3"], "algorithm.eps_clip_hi"),
        (["nonsense=1"], "nonsense"),
        (["algorithm.group_size=3"], "algorithm.group_size"),  # 8 sessions in groups of 3
        (["algorithm.dual_clip=0.5"], "algorithm.dual_clip"),
        (["algorithm.eps_clip=1.0"], "algorithm.eps_clip"),  # passed once, failed in the loss
        (["algorithm.eps_clip_high=0"], "algorithm.eps_clip_high"),
        (["algorithm.kl_coef=-1"], "algorithm.kl_coef"),
        (["algorithm.temperature=0"], "algorithm.temperature"),
        (["algorithm.off_temperature=ignore"], "algorithm.off_temperature"),
        (["algorithm.max_tokens_per_row=0"], "algorithm.max_tokens_per_row"),
        (["algorithm.max_tokens_per_microbatch=0"], "algorithm.max_tokens_per_microbatch"),
        (["algorithm.behaviour_cap=1"], "algorithm.behaviour_cap"),
        (["algorithm.discount=1.5"], "algorithm.discount"),
        (["algorithm.ppo_minibatches=9"], "algorithm.ppo_minibatches"),
        (["algorithm.decoupled=maybe"], "algorithm.decoupled"),
        (["algorithm=3"], "algorithm"),
        (["cluster.device=tpu"], "cluster.device"),
        (["publish.mode=carrier-pigeon"], "publish.mode"),
    ],
)
def test_bad_values_fail_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*BASE, *overrides])
    assert caught.value.field_name == field


def test_max_steps_zero_trains_until_stopped_and_below_zero_is_refused():
    assert load_config(None, [*BASE, "max_steps=0"]).max_steps == 0
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*BASE, "max_steps=-1"])
    assert caught.value.field_name == "max_steps" and "0: until stopped" in str(caught.value)


def test_neither_server_nor_model_is_refused():
    with pytest.raises(ConfigError) as caught:
        load_config(None, [])
    assert caught.value.field_name == "server"


def test_nullable_fields_take_null_and_numbers():
    config = load_config(None, [*BASE, "algorithm.behaviour_cap=null", "algorithm.dual_clip=3"])
    assert config.algorithm.behaviour_cap is None and config.algorithm.dual_clip == 3.0


def test_admin_key_from_the_environment_and_masked(monkeypatch):
    monkeypatch.setenv("PROXRL_ADMIN_KEY", "sekret")
    config = load_config(None, BASE)
    assert config.admin_key == "sekret"
    assert to_dict(config)["admin_key"] == "***"
    assert "sekret" not in "\n".join(describe())


def test_the_config_is_frozen():
    config = load_config(None, BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]


def test_example_configs_load():
    examples = sorted((ROOT / "examples").glob("train-*.yaml"))
    assert examples, "examples/train-*.yaml ship with the project"
    for path in examples:
        load_config(path, BASE)


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_proxrl_train_help_lists_the_fields():
    out = _train("--help")
    assert out.returncode == 0
    for name in ("batch_size", "max_staleness", "world_size", "algorithm.eps_clip", "lr"):
        assert name in out.stdout


def test_proxrl_train_refuses_a_bad_value_before_starting_anything():
    out = _train("--server", "http://127.0.0.1:9", "algorithm.eps_clip=-1")
    assert out.returncode == 2
    assert "algorithm.eps_clip" in out.stderr
