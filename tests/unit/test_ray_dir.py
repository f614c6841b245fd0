"""The local Ray's directory stays short whatever $TMPDIR is: Ray's AF_UNIX socket paths under
it (``session_<date>_<pid>/sockets/plasma_store``) must fit in 107 bytes."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from trainer.cluster import RAY_DIR_MAX_CHARS, private_ray_dir

SOCKET = "/session_2026-11-26_08-00-00_123456_4194304/sockets/plasma_store"


def test_a_long_tmpdir_gives_a_short_private_directory(tmp_path, monkeypatch):
    long_tmp = tmp_path / ("t" * 100)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    directory = private_ray_dir()
    try:
        assert len(directory) <= RAY_DIR_MAX_CHARS
        assert len((directory + SOCKET).encode()) <= 107
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    finally:
        shutil.rmtree(directory)


def test_a_short_tmpdir_is_used(tmp_path, monkeypatch):
    short = tempfile.mkdtemp(prefix="t", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", short)
    try:
        directory = private_ray_dir()
        assert os.path.dirname(directory) == short
    finally:
        shutil.rmtree(short)
