"""examples/algorithms/: every file loads with the trainer's own loader, and every entry of the
objectives table and every loss option has an example that uses it (the live runs,
tests/integration/test_algorithms_live.py, train every option of them)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from trainer.config import AlgorithmConfig, TrainConfig, load_config
from trainer.objectives import OBJECTIVES
from trainer.objectives.kl import KL_ESTIMATORS

EXAMPLES = Path(__file__).parents[2] / "examples" / "algorithms"


def load(path: Path) -> TrainConfig:
    return load_config(path, ["server=http://127.0.0.1:9"])


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_loads_with_the_trainer_s_loader(path):
    config = load(path)
    assert config.max_steps > 0 and path.read_text().startswith("#")  # says what it shows


def test_every_objective_and_loss_option_has_an_example():
    algorithms = [load(path).algorithm for path in EXAMPLES.glob("*.yaml")]
    assert {a.objective for a in algorithms} >= set(OBJECTIVES)
    aggregations = typing.get_args(typing.get_type_hints(AlgorithmConfig)["aggregation"])
    assert {a.aggregation for a in algorithms} >= set(aggregations)
    assert {a.kl_estimator for a in algorithms if a.kl_coef > 0} & (set(KL_ESTIMATORS) - {"k3"})
    assert any(a.entropy_coef > 0 for a in algorithms)
