"""A key proxrl makes up is printed to a terminal, and only there: with stdout a pipe or a file
(a service manager's journal) it goes to a file of mode 0600 and the line names the file."""

from __future__ import annotations

import io
import os
import pty
import sys

from server.common.key_handover import hand_over

KEY = "proxrl-admin-secret-value"


def test_a_terminal_sees_the_key_and_no_file_is_written(tmp_path, monkeypatch):
    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as terminal:
            monkeypatch.setattr(sys, "stdout", terminal)
            hand_over("admin key", KEY, tmp_path / "admin-key")
        shown = os.read(leader, 4096).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert shown.strip() == f"admin key: {KEY}"
    assert not (tmp_path / "admin-key").exists()


def test_a_journal_sees_the_file_not_the_key(tmp_path, monkeypatch):
    journal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", journal)
    file = tmp_path / "data" / "admin-key"
    file.parent.mkdir()
    file.write_text("an older key, readable by all\n")
    file.chmod(0o644)
    hand_over("admin key", KEY, file)
    assert KEY not in journal.getvalue() and str(file) in journal.getvalue()
    assert file.read_text() == KEY + "\n"
    assert file.stat().st_mode & 0o777 == 0o600
