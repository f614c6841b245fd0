"""The weight group's rendezvous store, served by the trainer (rank 0), listens on the address
the engines are given and nowhere else (torch's own store listens on every interface)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from server.common.weight_transfer import join_group, leave_group
from tests.support import ROOT, free_port, is_loopback_address, listening

RANK_1 = """
import sys
from server.common.weight_transfer import join_group, leave_group
leave_group(join_group("127.0.0.1", int(sys.argv[1]), 1, 2, "store_test_group", "gloo"))
"""


def test_rank_0_serves_the_store_on_master_address_only():
    port = free_port()
    joined: list = []
    rank_0 = threading.Thread(
        target=lambda: joined.append(
            join_group("127.0.0.1", port, 0, 2, "store_test_group", "gloo")
        )
    )
    rank_0.start()
    try:
        deadline = time.monotonic() + 30
        while not (on_port := [a for a, p in listening(os.getpid()) if p == port]):
            assert time.monotonic() < deadline, f"nothing listens on port {port}"
            time.sleep(0.05)
        assert all(is_loopback_address(address) for address in on_port), on_port
    finally:  # rank 1 joins, so that rank 0 is not left waiting
        subprocess.run([sys.executable, "-c", RANK_1, str(port)], cwd=ROOT, check=True, timeout=120)
        rank_0.join(120)
    assert len(joined) == 1
    leave_group(joined[0])
