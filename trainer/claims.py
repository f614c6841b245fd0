"""The trainer's claims: what it holds, kept alive until confirmed, checked at every turn.

A claim is a lease. `Leases` renews every claim the trainer holds (from a thread of its own,
a quarter of the lease apart, and before a new claim if the last renewal is half a lease old),
until a checkpoint covers it and it is confirmed or it is released. So a trainer that is alive
never loses a claim to the lease, however slow its steps; a dead one's claims return to the
pool after one lease.

The server answers each renewal with how many sessions the claim still holds. Fewer than it was
given means another claim took some after a lapse (the server could not be reached for longer
than the lease): those sessions may be trained twice. The trainer does not go on as if nothing
happened: `check` raises `ClaimLost`, before anything more is trained, and so does a confirm
that settles fewer sessions than the claim held.

This module knows the claims' ids and sizes, not what is in them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from trainer.server_api import ServerAPI, ServerError

log = logging.getLogger("proxrl.trainer")


class ClaimLost(RuntimeError):
    """Sessions of a claim this trainer holds were handed to another claim."""


@dataclass
class Claim:
    """One claim: its sessions, and those the trainer dropped (with why) once it saw them."""

    claim_id: str
    session_ids: list[str]
    dropped: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.session_ids)

    def covered(self) -> dict:
        """As a checkpoint records it."""
        return {"claim_id": self.claim_id, "sessions": self.size, "dropped": self.dropped}


def lost_message(claim_id: str, settled: int, size: int, when: str) -> str:
    return (
        f"claim {claim_id}: {size - settled} of its {size} sessions were handed to another "
        f"claim ({when}), so they may be trained twice. The trainer could not renew the "
        "lease in time: raise claim_lease_s, or check what kept it from the server."
    )


class Leases:
    """Renews the claims this trainer holds until they are let go."""

    def __init__(self, server: ServerAPI, lease_s: float) -> None:
        self.server = server  # a client of its own: the thread must not share the loop's
        self.lease_s = lease_s
        self.interval_s = min(max(lease_s / 4, 0.1), 60.0)
        self._held: dict[str, int] = {}
        self._lost: list[str] = []
        self._renewed_at = float("-inf")  # when the last renewal that reached the server began
        self._lock = threading.Lock()  # the held claims, the losses, the time of the last renewal
        self._calling = threading.Lock()  # one renewal call at a time on the one client
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="proxrl-leases", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 30)
            self._thread = None
        self.server.close()

    def hold(self, claim_id: str, size: int) -> None:
        """Keep ``claim_id`` alive; ``size`` sessions of it must stay claimed (lower it before
        dropping some, so that a renewal racing the drop never counts them lost)."""
        with self._lock:
            self._held[claim_id] = size

    def let_go(self, claim_id: str) -> None:
        with self._lock:
            self._held.pop(claim_id, None)

    def renew(self) -> None:
        """Renew every held claim now; remember the ones that lost sessions."""
        started = time.monotonic()
        with self._lock:
            held = dict(self._held)
        if not held:
            return
        with self._calling:
            counts = self.server.renew(list(held), self.lease_s)
        with self._lock:
            self._renewed_at = max(self._renewed_at, started)
            for claim_id in held:
                expected = self._held.get(claim_id)  # now: a drop may have lowered it meanwhile
                count = counts.get(claim_id, 0)
                if expected is not None and count < expected:
                    self._lost.append(lost_message(claim_id, count, expected, "renew"))

    def renew_if_due(self) -> None:
        """Renew now unless a renewal began less than half a lease ago: before a new claim, so
        that no lapsed session of ours can be handed to us (or anyone) a second time."""
        with self._lock:
            due = time.monotonic() - self._renewed_at > self.lease_s / 2
        if not due:
            return
        try:
            self.renew()
        except ServerError as exc:  # the thread keeps trying; a loss still shows in check()
            log.warning("could not renew the trainer's claims: %s", exc)

    def check(self) -> None:
        """Raise `ClaimLost` if a renewal found a claim that lost sessions."""
        with self._lock:
            lost = list(self._lost)
        if lost:
            raise ClaimLost("; ".join(lost))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.renew()
            except ServerError as exc:  # the server is away: try again soon, the lease is long
                log.warning("could not renew the trainer's claims: %s", exc)
            except Exception:  # the thread must outlive any surprise, or leases lapse
                log.exception("renewing the trainer's claims failed")
