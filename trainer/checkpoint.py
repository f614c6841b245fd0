"""What a restarted trainer needs to go on exactly where the last checkpoint left off.

A checkpoint is a directory ``checkpoints/step-NNNNNN`` holding the workers' model and optimizer
(``train_state.pt``, written by the workers; a LoRA run's holds the adapter and its optimizer
state alone, with the run's ``lora`` settings) and ``trainer.json``: the run and server it belongs
to, the step, the policy version, the versions republished after restarts (the staleness rule
needs them), the running baseline, the claims whose sessions the checkpointed weights were
trained on, each with its size and the sessions the trainer dropped (with their reasons), and
the run's totals of tokens sampled, trained and masked and of sessions dropped.

Claims are confirmed (their sessions marked consumed, or dropped) only once a checkpoint covers
them, and every claim is written to a journal (``claims.jsonl``) the moment it is taken, and
again, with the version it trained into, once that version is published. On restart a
journalled claim that the checkpoint covers is confirmed; one that trained into a version after
the checkpoint is released, unless a rollback the restarted trainer follows restores a version
that holds it (it is confirmed then); any other one is released: so no session is trained twice
or skipped across a crash. A republish (the restored
weights served under a new version) is journalled before it happens, and stays in the journal
until a checkpoint holds it, so a second crash cannot lose it. So are the tallies of sessions
the trainer dropped (what they sampled, and why dropped) once the server knows: a dropped
session is never claimed again, so a restart adds the tallies of every claim its checkpoint
does not cover to the restored totals, and keeps them journalled until a checkpoint holds
them. A checkpoint of another run
is refused (`WrongCheckpoint`), never resumed. This module only reads and writes files.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class WrongCheckpoint(RuntimeError):
    """The output directory holds another run's checkpoints."""


@dataclass
class TrainerState:
    run_id: str = ""
    server: str = ""
    step: int = 0
    version: int = 0
    republished: list[list[int]] = field(default_factory=list)  # [checkpoint version, new one]
    baseline: dict[str, Any] = field(default_factory=dict)
    # {"claim_id", "sessions": how many it holds, "dropped": {session_id: reason}}
    covered_claims: list[dict[str, Any]] = field(default_factory=list)
    # The run's totals of what was sampled and what of it trained, over every claimed session
    # (a step that trained nothing included): restored with the checkpoint, so a resumed
    # trainer adds what it trains again to its checkpoint's totals.
    total_sampled_tokens: int = 0
    total_trained_tokens: int = 0
    total_masked_tokens: dict[str, int] = field(default_factory=dict)  # cause -> tokens
    total_dropped_sessions: dict[str, int] = field(default_factory=dict)  # reason code -> sessions
    # [version, sessions]: the sessions a checkpoint confirmed (consumed) as trained into each
    # version of the lineage the weights descend from. A rollback to c discards the versions
    # after c, and with them these sessions, which the server will not hand out again: the
    # trainer counts them (`trainer.rollback.discarded`) and forgets them.
    consumed_into: list[list[int]] = field(default_factory=list)

    @property
    def total_trained_share(self) -> float:
        """Trained tokens over sampled ones, so far (1.0 before anything was sampled)."""
        if not self.total_sampled_tokens:
            return 1.0
        return self.total_trained_tokens / self.total_sampled_tokens

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        known = {key: data[key] for key in cls.__dataclass_fields__ if key in data}
        state = cls(**known)
        state.covered_claims = [  # before claims had sizes, they were bare ids
            claim if isinstance(claim, dict) else {"claim_id": claim, "sessions": None}
            for claim in state.covered_claims
        ]
        return state

    def check_owner(self, run_id: str, server: str, where: Path) -> None:
        """Refuse to resume a checkpoint that another run wrote."""
        if self.run_id == run_id:
            return
        owner = (
            f"run {self.run_id} (server {self.server or '?'})"
            if self.run_id
            else "a run it does not name (written before checkpoints recorded their run)"
        )
        raise WrongCheckpoint(
            f"{where} holds checkpoints of {owner}; this trainer trains run {run_id} on "
            f"{server}. Give this run an output_dir of its own, or run_id={self.run_id or '...'} "
            "to resume that run."
        )


class Checkpoints:
    def __init__(self, output_dir: Path, keep: int) -> None:
        self.root = output_dir / "checkpoints"
        self.journal = output_dir / "claims.jsonl"
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def latest(self) -> tuple[Path, TrainerState] | None:
        """The newest complete checkpoint (``trainer.json`` is written last)."""
        found = self.complete()
        return found[-1] if found else None

    def complete(self) -> list[tuple[Path, TrainerState]]:
        """Every complete checkpoint, oldest first."""
        return [
            (path, TrainerState.from_json(json.loads((path / "trainer.json").read_text())))
            for path in sorted(self.root.glob("step-*"))
            if (path / "trainer.json").exists()
        ]

    def forget(self, step: int) -> None:
        """Remove the checkpoint of ``step`` (its marker first: never half a checkpoint that
        counts), to save another at that step: the weights a rollback restored."""
        path = self.path(step)
        (path / "trainer.json").unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)

    def commit(self, path: Path, state: TrainerState) -> None:
        """Mark the checkpoint at ``path`` complete, then prune older ones."""
        _write_atomic(path / "trainer.json", json.dumps(asdict(state)))
        done = [p for p in sorted(self.root.glob("step-*")) if (p / "trainer.json").exists()]
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in self.root.glob("step-*"):
            if not (partial / "trainer.json").exists() and partial != path:
                shutil.rmtree(partial, ignore_errors=True)

    # ----- the claim journal ----------------------------------------------------------------

    def journal_claim(self, claim_id: str, step: int, sessions: int) -> None:
        self._append({"claim_id": claim_id, "step": step, "sessions": sessions})

    def journal_trained(self, version: int, claims: list[dict[str, Any]]) -> None:
        """The claims (each as ``dataclasses.asdict(Claim)``: its id, session ids and drops)
        that trained into ``version``, once it is published: a restart that follows a rollback
        to that version or a later one confirms them (the weights it restores hold them)."""
        self._append(*({"trained_into": version, "claim": claim} for claim in claims))

    def journal_republish(self, restored: int, version: int) -> None:
        self._append({"republished": [restored, version]})

    def journal_drops(self, claim_id: str, tally: dict[str, Any]) -> None:
        """What the sessions of ``claim_id`` that the server now knows dropped had sampled
        (``tally``: tokens and reasons, as `figures.drop_tally` counts them). They are never
        claimed again, so a restart that does not resume from a checkpoint covering the claim
        adds them to the restored totals (`journalled_drops`)."""
        self._append({"drops_of": claim_id, "tally": tally})

    def _append(self, *records: dict[str, Any]) -> None:
        with self.journal.open("a") as f:
            f.write("".join(json.dumps(record) + "\n" for record in records))
            f.flush()
            os.fsync(f.fileno())

    def _records(self) -> list[dict[str, Any]]:
        if not self.journal.exists():
            return []
        return [json.loads(line) for line in self.journal.read_text().splitlines() if line.strip()]

    def journalled(self) -> list[str]:
        """The claims taken since the journal was last cleared, in order."""
        return [record["claim_id"] for record in self._records() if "claim_id" in record]

    def journalled_trained(self) -> dict[str, tuple[int, dict[str, Any]]]:
        """The journalled claims whose version was published: claim id -> (that version, the
        claim as `journal_trained` took it)."""
        return {
            r["claim"]["claim_id"]: (r["trained_into"], r["claim"])
            for r in self._records()
            if "trained_into" in r
        }

    def journalled_republishes(self) -> list[list[int]]:
        """The republishes no checkpoint holds yet, in order."""
        return [record["republished"] for record in self._records() if "republished" in record]

    def journalled_drops(self) -> dict[str, dict[str, Any]]:
        """The drop tallies no checkpoint holds yet, by claim."""
        return {r["drops_of"]: r["tally"] for r in self._records() if "drops_of" in r}

    def clear_journal(
        self,
        republished: list[list[int]] | None = None,
        drops: dict[str, dict[str, Any]] | None = None,
        trained: dict[str, tuple[int, dict[str, Any]]] | None = None,
    ) -> None:
        """Forget the journal but for ``republished``, ``drops`` (by claim) and ``trained`` (as
        `journalled_trained` gives them): those no checkpoint holds yet (a restart counted them
        in totals that only the next checkpoint keeps, or has yet to settle the claims)."""
        records: list[dict[str, Any]] = [{"republished": pair} for pair in republished or []]
        records += [{"drops_of": claim, "tally": tally} for claim, tally in (drops or {}).items()]
        for claim_id, (version, claim) in (trained or {}).items():
            taken = {"claim_id": claim_id, "sessions": len(claim["session_ids"])}
            records += [taken, {"trained_into": version, "claim": claim}]
        _write_atomic(self.journal, "".join(json.dumps(r) + "\n" for r in records))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
