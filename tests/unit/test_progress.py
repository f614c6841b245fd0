"""The per-step figures (trainer/figures.py: combine, step_record) and the progress log.

The loss statistics come from the real `decoupled_ppo_loss` on small float64 tensors, summed
over two micro-batches as the loop sums them; every figure is checked against a per-token
Python reference to 1e-12.
"""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from trainer import figures
from trainer.checkpoint import TrainerState
from trainer.config import AlgorithmConfig
from trainer.figures import ETA_WINDOW, Phases, Progress, combine, eta_seconds, step_record
from trainer.loss import decoupled_ppo_loss
from trainer.rollouts import ALTERNATIVE, OFF_TEMPERATURE, STALE, Batch, Sample

TOL = 1e-12
CAP = 1.5


def sample(advantages: list[float], mask: list[int]) -> Sample:
    return Sample(
        session_id="s",
        input_ids=[1] * len(mask),
        loss_mask=mask,
        behaviour=[0.0] * len(mask),
        versions=[0 if m else -1 for m in mask],
        advantages=advantages,
    )


def make_batch() -> Batch:
    samples = [
        # advantages on prompt tokens are never trained: the figures must leave them out
        sample([9.0, 9.0, 0.5, 0.5, 0.5], [0, 0, 1, 1, 1]),
        sample([-9.0, -1.25, -1.25], [0, 1, 1]),
        sample([0.0, 2.0, 7.0, 2.0], [0, 1, 0, 1]),
    ]
    return Batch(
        samples=samples,
        rewards=[1.0, 0.0, 0.5],
        staleness=[0, 1, 1, 2, 0, 0, 1],
        session_ids=["a", "b", "c"],
    )


def micro_batch_tensors(seed: int, size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    proximal = -torch.rand(size, generator=g, dtype=torch.float64) * 3
    return {
        "logprobs": proximal + torch.randn(size, generator=g, dtype=torch.float64) * 0.3,
        "proximal_logprobs": proximal,
        "behaviour_logprobs": proximal + torch.randn(size, generator=g, dtype=torch.float64) * 0.6,
        "advantages": torch.randn(size, generator=g, dtype=torch.float64),
        "loss_mask": torch.rand(size, generator=g) > 0.3,
        "reference_logprobs": proximal + torch.randn(size, generator=g, dtype=torch.float64) * 0.2,
    }


def loss_stats(micros: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The workers' sums over micro-batches, as Worker.train_step and Trainer.train add them."""
    total = sum(int(m["loss_mask"].sum()) for m in micros)
    totals: dict[str, float] = {}
    for m in micros:
        algorithm = AlgorithmConfig(behaviour_cap=CAP, behaviour_mode="token_mask", kl_coef=0.1)
        _, stats = decoupled_ppo_loss(**m, total_tokens=total, algorithm=algorithm)
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def reference_figures(micros: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Token by token in Python floats: fractions over loss tokens, means over kept ones."""
    tokens = over_cap = 0
    ratios, kls, reference_kls = [], [], []
    for m in micros:
        rows = zip(
            m["logprobs"].tolist(),
            m["proximal_logprobs"].tolist(),
            m["behaviour_logprobs"].tolist(),
            m["reference_logprobs"].tolist(),
            m["loss_mask"].tolist(),
            strict=True,
        )
        for logp, prox, behav, ref, in_loss in rows:
            if not in_loss:
                continue
            tokens += 1
            if math.exp(prox - behav) > CAP:
                over_cap += 1  # token_mask: dropped
                continue
            ratios.append(math.exp(logp - prox))
            kls.append(math.exp(prox - logp) - (prox - logp) - 1)
            reference_kls.append(math.exp(ref - logp) - (ref - logp) - 1)
    return {
        "behaviour_over_cap_fraction": over_cap / tokens,
        "behaviour_masked_fraction": over_cap / tokens,
        "ratio_mean": statistics.fmean(ratios),
        "approx_kl": statistics.fmean(kls),
        "reference_kl": statistics.fmean(reference_kls),
    }


def test_step_figures_against_a_token_by_token_reference():
    batch = make_batch()
    micros = [micro_batch_tensors(0, 23), micro_batch_tensors(1, 17)]
    stats = loss_stats(micros)
    stats.update(
        entropy_sum=12.5, seconds=3.0, proximal_seconds=0.75, mismatch_sum=0.2, mismatch_tokens=4
    )
    state = TrainerState(step=4, version=9)
    record = step_record(state, batch, stats, Phases(claim=0.5, publish=0.25, checkpoint=2.0), True)

    want = reference_figures(micros)
    assert want["behaviour_over_cap_fraction"] > 0  # the cap is hit: the case tests something
    for key, value in want.items():
        assert record[key] == pytest.approx(value, rel=0, abs=TOL), key

    trained = [0.5, 0.5, 0.5, -1.25, -1.25, 2.0, 2.0]  # loss tokens only
    assert record["advantage_mean"] == pytest.approx(statistics.fmean(trained), abs=TOL)
    assert record["advantage_std"] == pytest.approx(statistics.pstdev(trained), abs=TOL)
    assert (record["advantage_min"], record["advantage_max"]) == (-1.25, 2.0)

    assert record["entropy"] == pytest.approx(12.5 / stats["tokens"], abs=TOL)
    assert record["logprob_mismatch_mean"] == pytest.approx(0.05, abs=TOL)
    assert (record["staleness_mean"], record["staleness_max"]) == (5 / 7, 2)
    assert record["staleness_histogram"] == [3, 3, 1]
    phases = {
        key: record[f"{key}_seconds"]
        for key in ("claim", "train", "proximal", "update", "publish", "checkpoint")
    }
    assert phases == {
        "claim": 0.5,
        "train": 3.0,
        "proximal": 0.75,
        "update": 2.25,
        "publish": 0.25,
        "checkpoint": 2.0,
    }
    assert record["tokens_per_second"] == pytest.approx(7 / 3.25, abs=TOL)
    json.dumps(record)  # it goes to metrics.jsonl and over HTTP as is


def test_reference_kl_only_when_trained_with_a_reference():
    record = step_record(TrainerState(step=1, version=1), make_batch(), {}, Phases(0.0, 0.0))
    assert "reference_kl" not in record


def test_an_empty_step_has_finite_figures():
    empty = Batch([], session_ids=["a", "b"], dropped={"a": "no_turns: x", "b": "stale: y"})
    record = step_record(TrainerState(step=1, version=1), empty, {}, Phases(0.1, 0.0), True)
    assert record["dropped_sessions"] == 2
    assert record["dropped_no_turns"] == record["dropped_stale"] == 1
    numbers = [v for v in record.values() if isinstance(v, float)]
    assert numbers and all(math.isfinite(v) for v in numbers)
    assert record["advantage_std"] == 0.0 and record["entropy"] == 0.0
    assert record["logprob_mismatch_mean"] is None


def test_every_step_is_recorded_and_a_line_printed_every_log_every_steps(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    posted: list[dict] = []
    progress = Progress(max_steps=7, first_step=0, path=path, log_every=3)
    progress.report = posted.append
    rng = random.Random(0)
    with caplog.at_level(logging.INFO, logger="proxrl.trainer"):
        for step in range(1, 8):
            stats = {"seconds": rng.uniform(1, 2), "proximal_seconds": 0.5, "tokens": 7.0}
            progress.step(TrainerState(step=step, version=step), make_batch(), stats, Phases(1, 1))
    lines = [r.getMessage() for r in caplog.records if r.name == "proxrl.trainer"]
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"]  # and always the last
    for name in ("claim", "prox", "update", "publish", "ckpt", "entropy", "loss"):
        assert f" {name} " in lines[0], (name, lines[0])
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in written] == [r["step"] for r in posted] == list(range(1, 8))


def test_masked_and_off_policy_shares_are_over_every_sampled_token():
    batch = make_batch()  # 7 loss tokens
    batch.masked.update({STALE: 1, OFF_TEMPERATURE: 4, ALTERNATIVE: 2})
    batch.off_policy_tokens = 3
    record = step_record(TrainerState(step=1, version=1), batch, {}, Phases(0.0, 0.0), False, 0.7)
    assert (record["stale_tokens"], record["off_temperature_tokens"]) == (1, 4)
    assert (record["alternative_tokens"], record["off_policy_tokens"]) == (2, 3)
    assert record["off_temperature_masked_fraction"] == pytest.approx(4 / 14, abs=TOL)
    assert record["off_policy_fraction"] == pytest.approx(3 / 14, abs=TOL)
    assert record["temperature"] == 0.7


def worker_result(rng: random.Random, minibatches: int, grad_norms: list[float]) -> dict:
    sums = {
        name: rng.uniform(0, 10) for name in ("loss_sum", "tokens", "entropy_sum", "kept_tokens")
    }
    return {**sums, "grad_norms": grad_norms, "seconds": rng.uniform(1, 2), "proximal_seconds": 0.5}


def test_figures_do_not_depend_on_how_many_workers_shared_the_sums():
    """Two workers return halves of the sums and the same per-minibatch grad norms (they are
    computed on the whole model); the figures equal one worker's on the whole."""
    rng = random.Random(1)
    norms = [0.5, 1.5, 4.0]  # three PPO minibatches
    one = worker_result(rng, 3, norms)
    halves = [dict(one), dict(one)]
    for key in ("loss_sum", "tokens", "entropy_sum", "kept_tokens"):
        halves[0][key] = one[key] * 0.25
        halves[1][key] = one[key] * 0.75
    halves[1]["seconds"] = one["seconds"] + 0.5  # the step waits for the slowest worker
    alone = combine([one])
    shared = combine(halves)
    state, phases = TrainerState(step=1, version=1), Phases(0.0, 0.0)
    a = step_record(state, make_batch(), alone, phases)
    b = step_record(state, make_batch(), shared, phases)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-12)
    assert a["loss"] == pytest.approx(one["loss_sum"] / 3, rel=1e-12)  # the minibatches' mean
    assert a["grad_norm"] == b["grad_norm"] == pytest.approx(2.0)  # mean, not sum, of the norms
    assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-12)
    assert b["train_seconds"] == one["seconds"] + 0.5


def test_no_eta_until_three_intervals_then_the_recent_pace():
    assert eta_seconds([], 10) is None
    assert eta_seconds([100.0], 10) is None  # the first step: start-up, not a pace
    assert eta_seconds([100.0, 102.0, 104.0], 10) is None
    # start-up of 5 minutes before the first step, then 2 s a step: 2 s a step it is
    assert eta_seconds([300.0, 302.0, 304.0, 306.0], 10) == pytest.approx(20.0, abs=TOL)
    # the pace changes: only the last ETA_WINDOW intervals count
    ends = [10.0 * i for i in range(30)] + [290.0 + i for i in range(1, ETA_WINDOW + 1)]
    assert eta_seconds(ends, 100) == pytest.approx(100.0, abs=TOL)


def test_the_logged_eta_waits_for_steps_and_ignores_the_start_up(tmp_path, caplog, monkeypatch):
    clock = iter([300.0, 302.0, 304.0, 306.0, 308.0])  # a slow start, then 2 s a step
    # Only the module under test reads this clock: the time module stays the process's.
    monkeypatch.setattr(
        figures, "time", SimpleNamespace(monotonic=lambda: next(clock), time=time.time)
    )
    progress = Progress(max_steps=10_000, first_step=0, path=tmp_path / "m.jsonl", log_every=1)
    with caplog.at_level(logging.INFO, logger="proxrl.trainer"):
        for step in range(1, 6):
            stats = {"seconds": 2.0, "proximal_seconds": 0.5, "tokens": 7.0}
            progress.step(TrainerState(step=step, version=step), make_batch(), stats, Phases(1, 1))
    etas = [r.getMessage().rsplit("ETA ", 1)[1] for r in caplog.records if "ETA" in r.getMessage()]
    assert etas == ["after 4 steps"] * 3 + ["5h33m", "5h33m"]  # 9,996 and 9,995 steps of 2 s


def test_a_clean_stop_reposts_the_last_step_with_stopped_at(tmp_path):
    posted: list[dict] = []
    progress = Progress(max_steps=7, first_step=0, path=tmp_path / "m.jsonl")
    progress.stopped()  # no step yet: nothing to amend
    assert posted == []
    progress.report = posted.append
    progress.stopped()
    assert posted == []
    stats = {"seconds": 1.0, "proximal_seconds": 0.5, "tokens": 7.0}
    for step in (1, 2):
        progress.step(TrainerState(step=step, version=step), make_batch(), stats, Phases(1, 1))
    progress.stopped()
    assert [p["step"] for p in posted] == [1, 2, 2]
    assert posted[2]["stopped_at"] > 0 and "stopped_at" not in posted[1]
    assert {k: v for k, v in posted[2].items() if k != "stopped_at"} == posted[1]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2  # the file is as it was


def test_a_trainer_without_a_last_step_shows_no_eta(tmp_path, caplog):
    """max_steps=0 (the demo's: it trains until stopped) has no end to estimate."""
    progress = Progress(max_steps=0, first_step=0, path=tmp_path / "m.jsonl", log_every=2)
    with caplog.at_level(logging.INFO, logger="proxrl.trainer"):
        for step in range(1, 6):
            stats = {"seconds": 2.0, "proximal_seconds": 0.5, "tokens": 7.0}
            progress.step(TrainerState(step=step, version=step), make_batch(), stats, Phases(1, 1))
    lines = [r.getMessage() for r in caplog.records if r.name == "proxrl.trainer"]
    assert [line.split(" · ")[0] for line in lines] == ["step 2", "step 4"]  # every log_every
    assert all(line.endswith("· until stopped") and "ETA" not in line for line in lines)
