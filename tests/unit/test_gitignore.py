"""The default output folders of the commands a new user runs first are git-ignored, so a first
`make demo` or `proxrl train` leaves `git status` clean."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support import ROOT
from trainer.config import TrainConfig


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("folder", [TrainConfig.output_dir, "demo-out", "data", ".proxrl-cache"])
def test_default_output_folders_are_ignored(folder):
    path = f"{folder}/metrics.jsonl"
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, check=False
    )
    assert result.returncode == 0, f"{folder}/ is not in .gitignore"
