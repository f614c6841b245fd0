"""Weight files are checked before a publish pauses anything: the tiny model's pass; a FIFO, a
truncated file, a header that lies are named; a read that blocks is given up on at its deadline,
its thread left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time

from server.rl.weight_files import problem_of, within


def test_a_real_checkpoint_passes_and_a_missing_path_is_not_judged(tiny_model_dir, tmp_path):
    assert problem_of(str(tiny_model_dir)) is None
    assert problem_of(str(tmp_path / "only-on-the-engines-machine")) is None


def test_unloadable_files_are_named(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-1])
    assert "truncated" in str(problem_of(str(model)))
    weights.write_bytes((10**9).to_bytes(8, "little") + whole[8:])
    assert "header claims" in str(problem_of(str(model)))
    weights.unlink()
    assert "no *.safetensors" in str(problem_of(str(model)))
    os.mkfifo(weights)
    assert problem_of(str(model)) == "model.safetensors: not a regular file"


def test_a_read_that_blocks_is_given_up_at_the_deadline(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def blocked() -> str | None:
        with open(fifo, "rb"):  # blocks until a writer comes
            return None

    started = time.perf_counter()
    problem = asyncio.run(within(0.5, blocked, "reading"))
    assert problem is not None and "within 0.5 s" in problem
    assert time.perf_counter() - started < 2.0
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # release the thread left behind
