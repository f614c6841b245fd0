"""The training loop: claim → samples → update → publish → checkpoint → log → confirm.

``Trainer.run`` reads top to bottom like the recipe. Generation never waits for it: the server
keeps serving while a step trains, and new weights are swapped into the engines in place.
Each phase is a call into a module that owns it (``rollouts`` for what trains and why not,
``plan`` and the workers (``algorithm`` on their backend) for the update, ``publish``,
``checkpoint``, ``claims`` for leases, ``figures`` for what is reported); this module only
orders them and keeps the books.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from trainer import failpoints
from trainer.advantages import RunningBaseline
from trainer.checkpoint import Checkpoints, TrainerState
from trainer.claims import Claim, ClaimLost, Leases, lost_message
from trainer.cluster import WorkerGroup
from trainer.config import AlgorithmConfig, TrainConfig, to_dict
from trainer.figures import (
    Phases,
    Progress,
    add_counts,
    add_tally,
    add_to_totals,
    combine,
    drop_tally,
    reason_codes,
    share_warning,
)
from trainer.model import check_supported
from trainer.plan import plan_step
from trainer.publish import Publisher
from trainer.rollback import (
    ROLLED_BACK,
    discarded,
    new_rollbacks,
    plan_restore,
    served_weights,
    to_release,
)
from trainer.rollouts import Batch, Rules, build_batch
from trainer.server_api import ServerAPI, ServerError, VersionSuperseded
from trainer.tracking import RunInfo, Tracking, check_installed
from trainer.worker import WorkerSettings

log = logging.getLogger("proxrl.trainer")

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


# Settings of the algorithm that the run's config holds, as the one value both sides use: the
# trainer writes those its config sets at start, then follows the run's from claim to claim.
RUN_HELD = ("temperature", "off_temperature", "group_size")
# The trainer's own settings it follows the same way (it writes its config's at start).
RUN_PACE = ("batch_size", "max_staleness")


def run_held(algorithm: AlgorithmConfig) -> dict[str, Any]:
    """The values of `RUN_HELD` that the trainer's own config sets (null: the run's)."""
    return {key: getattr(algorithm, key) for key in RUN_HELD if getattr(algorithm, key) is not None}


def follow_run(algorithm: AlgorithmConfig, run_config: dict[str, Any]) -> AlgorithmConfig:
    """The algorithm with the run's temperature, off-temperature rule and group size (the run's
    effective config, as the server answers it, holds every one)."""
    return dataclasses.replace(
        algorithm,
        temperature=float(run_config["temperature"]),
        off_temperature=run_config["off_temperature"],
        group_size=run_config.get("group_size") or 1,
    )


@dataclasses.dataclass(frozen=True)
class Followed:
    """What the trainer takes from the run's config at every claim: the algorithm's `RUN_HELD`
    settings, the sessions per step and the staleness bound."""

    algorithm: AlgorithmConfig
    batch_size: int
    max_staleness: int

    def changes(self, other: Followed) -> dict[str, Any]:
        """The settings whose values ``other`` changes, with its values."""
        mine = {**{k: getattr(self.algorithm, k) for k in RUN_HELD}, **self._pace()}
        theirs = {**{k: getattr(other.algorithm, k) for k in RUN_HELD}, **other._pace()}
        return {key: value for key, value in theirs.items() if value != mine[key]}

    def _pace(self) -> dict[str, int]:
        return {key: getattr(self, key) for key in RUN_PACE}


def followed_from(
    current: Followed, own: AlgorithmConfig, run_config: dict[str, Any]
) -> tuple[Followed, str | None]:
    """The settings of the run's config (``own``: the trainer's algorithm, whose other settings
    stay), and a warning when its batch size is not a multiple of the group size (the last
    valid one stays). An unset batch size (admission off) keeps the last one too, silently:
    the trainer's own is the one it trains with then."""
    algorithm = follow_run(own, run_config)
    batch_size = run_config.get("batch_size") or current.batch_size
    group_size = algorithm.group_size or 1
    refused = None
    if batch_size % group_size:
        refused = (
            f"the run's batch_size {batch_size} is not a multiple of its group_size "
            f"{group_size}; training {current.batch_size} sessions a step meanwhile"
        )
        batch_size = current.batch_size
    max_staleness = int(run_config.get("max_staleness", current.max_staleness))
    return Followed(algorithm, int(batch_size), max_staleness), refused


def row_limit(algorithm: AlgorithmConfig, model_dir: str) -> tuple[int | None, str]:
    """The longest row to train, and the name a drop reason gives it."""
    if algorithm.max_tokens_per_row is not None:
        return algorithm.max_tokens_per_row, "algorithm.max_tokens_per_row"
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int):
            return config[key], f"the model's context ({key} in its config.json)"
    return None, "algorithm.max_tokens_per_row"


def worker_settings(
    config: TrainConfig, model_dir: str, algorithm: AlgorithmConfig
) -> WorkerSettings:
    return WorkerSettings(
        model_dir=model_dir,
        lr=config.lr,
        optim=config.optim,
        algorithm=algorithm,
        seed=config.seed,
        device=config.cluster.device,
        threads=config.cluster.threads_per_worker,
        lora=config.lora,
    )


@dataclasses.dataclass
class Claimed:
    """The claims one step took, and their sessions."""

    claims: list[Claim] = dataclasses.field(default_factory=list)
    sessions: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def record_drops(self, dropped: dict[str, str]) -> None:
        for claim in self.claims:
            claim.dropped = {s: dropped[s] for s in claim.session_ids if s in dropped}


class Trainer:
    def __init__(self, config: TrainConfig, server: ServerAPI) -> None:
        check_installed(config.tracking)  # a configured tracker is there before anything runs
        self.config = config
        self.server = server
        # once, on the driver: every path sent to the workers and the server is absolute
        # absolute, symlinks kept: the path other nodes mount may differ from this one's target
        self.output = Path(os.path.abspath(config.output_dir))
        self.output.mkdir(parents=True, exist_ok=True)
        self.checkpoints = Checkpoints(self.output, config.keep_checkpoints)
        run = server.run(config.run_id) if config.run_id else server.default_run()
        self.run_id: str = run["id"]
        self.model_dir: str = config.model or run["model_path"]
        self.followed = Followed(
            follow_run(config.algorithm, {**run["config"], **run_held(config.algorithm)}),
            config.batch_size,
            config.max_staleness,
        )
        self.refused: str | None = None  # the last warning of a run setting not followed
        self.min_trained_share: float | None = run["config"].get("min_trained_share")
        self.warned_at_step: int | None = None  # of the last low-trained-share warning
        if (Path(self.model_dir) / "config.json").exists():  # else only the workers see it
            # refused before Ray or a worker starts
            check_supported(self.model_dir, config.lora)
        self.row_limit = row_limit(self.algorithm, self.model_dir)
        self.server_version = int(run["policy_version"])
        self.state = TrainerState(
            run_id=self.run_id, server=server.url, version=self.server_version
        )
        self.baseline = RunningBaseline(config.algorithm.baseline_momentum)
        self.leases = Leases(server.clone(), config.claim_lease_s)
        self.pending: list[Claim] = []  # trained on, not yet covered by a checkpoint
        self.trained_into: dict[str, int] = {}  # of the pending claims: the version trained into
        self.confirmed: list[Claim] = []  # of batches that trained nothing: no checkpoint yet
        self.stopping = False
        found = self.checkpoints.latest()
        if found is not None:  # before anything starts: another run's checkpoint is refused
            found[1].check_owner(self.run_id, server.url, self.output)

    # ----- start ------------------------------------------------------------------------------

    def start(self, workers: WorkerGroup) -> None:
        """Configure the run, restore this run's last checkpoint, settle the claims it left."""
        self.workers = workers
        self.publisher = Publisher(self.config, self.server, self.run_id, workers, self.output)
        settings = {
            "batch_size": self.config.batch_size,
            "max_staleness": self.config.max_staleness,
            **run_held(self.config.algorithm),
        }
        self.follow(self.server.configure_run(self.run_id, settings)["config"])
        self.publisher.check_readable()  # before anything trains: a publish must land
        found = self.checkpoints.latest()
        if found is not None:
            path, state = found
            self.state = dataclasses.replace(state, server=self.server.url)
            workers.call("load_checkpoint", str(path))
            self.baseline.load_state_dict(state.baseline)
            log.info("resumed from %s: step %d, version %d", path, state.step, state.version)
        self.resume_claims()
        if self.server_version != self.state.version:
            self.republish()
        self.leases.start()

    def resume_claims(self) -> None:
        """Settle what the stopped run left in the journal: its republishes, its claims
        (`_settle_journal`), and those trained since the checkpoint, which a rollback made
        meanwhile keeps when the version it restores holds them (`follow_rollbacks`) and which
        are released otherwise. The rollback is worked out first, so no session is trained
        twice."""
        for pair in self.checkpoints.journalled_republishes():  # a crash lost its checkpoint
            if pair not in self.state.republished:
                self.state.republished.append(pair)
        self._settle_journal()
        if not self.follow_rollbacks():  # one made while this trainer was away
            self._release_trained_since_checkpoint()

    def republish(self) -> None:
        """The engines serve weights this trainer no longer has (trained after the last
        checkpoint): serve the restored ones under a new version. The staleness rule needs to
        know that version holds the checkpoint's weights, so it is journalled first."""
        restored = self.state.version
        version = max(self.server_version, restored) + 1
        self.checkpoints.journal_republish(restored, version)
        self.state.republished.append([restored, version])
        self.state.version = version
        self.publisher.publish(version)
        log.info("republished the weights of version %d as version %d", restored, version)

    def follow_rollbacks(self, claimed: Claimed | None = None) -> bool:
        """Follow the run's rollbacks this trainer has not followed (the last one counts):
        restore the weights of the version rolled back to (``trainer.rollback``), give back
        the claims trained into the versions it discarded (and count, as dropped, the sessions
        of those a checkpoint already confirmed: lost), count each rollback as a republish
        (journalled first, as ``republish``), and checkpoint at once, so a restart goes on from
        the restored weights (``claimed``: the step's claims, not trained yet, journalled
        again after it). Whether there was one."""
        listed = self.server.rollbacks(self.run_id)
        new = new_rollbacks(self.state.republished, listed, self.state.version)
        if not new:
            return False
        source, version = new[-1]
        restore = plan_restore(
            source,
            version,
            self.checkpoints.complete(),
            self.server.version_path(self.run_id, source) if source else None,
        )
        if restore.checkpoint is not None:
            self.workers.call("load_checkpoint", str(restore.checkpoint))
            found = [s for p, s in self.checkpoints.complete() if p == restore.checkpoint]
            self.baseline.load_state_dict(found[0].baseline)
        else:
            self.workers.call("load_published", restore.files)
        log.warning("%s", restore.says())
        held = served_weights(source, [*self.state.republished, *new])  # what it holds
        self.state.consumed_into, lost = discarded(self.state.consumed_into, held)
        if lost:
            add_counts(self.state.total_dropped_sessions, {ROLLED_BACK: lost})
            log.warning(
                "%d sessions trained into versions after %d were already confirmed (consumed) "
                "by a checkpoint: the rollback discarded their update and the server will not "
                "hand them out again, so they are lost to the run (counted as dropped: %s). "
                "Roll back only to versions at or after the trainer's last checkpoint, or "
                "raise checkpoint_every, to keep them",
                lost,
                held,
                ROLLED_BACK,
            )
        released = set(to_release(self.trained_into, held))
        for claim in [c for c in self.pending if c.claim_id in released]:
            self.leases.let_go(claim.claim_id)
            try:
                count = self.server.release(claim.claim_id)
            except ServerError as exc:  # its lease lapses: the sessions come back all the same
                log.warning("could not release claim %s: %s", claim.claim_id, exc)
                continue
            log.info(
                "released claim %s (%d sessions): trained into a version the rollback "
                "discarded, they train again on the restored weights",
                claim.claim_id,
                count,
            )
        self.pending = [c for c in self.pending if c.claim_id not in released]
        self.trained_into = {k: v for k, v in self.trained_into.items() if k not in released}
        for pair in new:
            self.checkpoints.journal_republish(*pair)
            self.state.republished.append(pair)
        self.state.version = self.server_version = version
        self.checkpoints.forget(self.state.step)  # it held the discarded weights
        self.commit_checkpoint(self.save_checkpoint())
        for claim in claimed.claims if claimed is not None else []:  # the commit cleared them
            self.checkpoints.journal_claim(claim.claim_id, self.state.step, claim.size)
        return True

    def abandon_step(self, claimed: Claimed, refused: VersionSuperseded) -> None:
        """The step's publish was refused: the run was rolled back meanwhile. The step's
        update is discarded with the weights it was made on, its claims given back with the
        others the rollback discarded."""
        self.state.version -= 1  # not published
        for claim in claimed.claims:
            self.trained_into[claim.claim_id] = self.state.version + 1
        log.warning("the step's publish was refused (%s); following the rollback", refused)
        if not self.follow_rollbacks():
            raise refused

    def _settle_journal(self) -> None:
        """Confirm the journalled claims the checkpoint covers; take those trained into a
        published version since back as pending (a rollback to that version or a later one
        keeps them, `follow_rollbacks`; else `_release_trained_since_checkpoint`), kept in the
        journal until settled; release the others; and count the sessions dropped from any not
        covered (never claimed again) in the restored totals."""
        covered = {c["claim_id"]: c for c in self.state.covered_claims}
        trained = self.checkpoints.journalled_trained()
        kept = {}
        for claim_id in dict.fromkeys(self.checkpoints.journalled()):
            if claim_id in covered:
                self._confirm(covered[claim_id], "on restart")
            elif claim_id in trained:
                version, record = kept[claim_id] = trained[claim_id]
                claim = Claim(**record)
                self.leases.hold(claim_id, claim.size - len(claim.dropped))
                self.pending.append(claim)
                self.trained_into[claim_id] = version
            else:
                released = self.server.release(claim_id)
                log.info(
                    "released claim %s (%d sessions) left by a stopped run", claim_id, released
                )
        uncounted = {
            claim_id: tally
            for claim_id, tally in self.checkpoints.journalled_drops().items()
            if claim_id not in covered
        }
        for tally in uncounted.values():
            add_tally(self.state, tally)
        self.checkpoints.clear_journal(self.state.republished, uncounted, trained=kept)

    def _release_trained_since_checkpoint(self) -> None:
        """On restart without a rollback to follow: the claims trained after the checkpoint
        (`_settle_journal`) are not in the weights it restored, so their sessions train again.
        Out of the journal first: a claim released and later confirmed would be lost."""
        if not self.pending:
            return
        store = self.checkpoints
        store.clear_journal(store.journalled_republishes(), store.journalled_drops())
        for claim in self.pending:
            self.leases.let_go(claim.claim_id)
            released = self.server.release(claim.claim_id)
            log.info(
                "released claim %s (%d sessions) trained after the checkpoint by a stopped run",
                claim.claim_id,
                released,
            )
        self.pending, self.trained_into = [], {}

    @property
    def algorithm(self) -> AlgorithmConfig:
        return self.followed.algorithm

    def follow(self, run_config: dict[str, Any]) -> None:
        """Take the run's temperature, off-temperature rule, group size, batch size and
        staleness bound, saying so when they change (and once when one cannot be followed)."""
        followed, refused = followed_from(self.followed, self.config.algorithm, run_config)
        changed = self.followed.changes(followed)
        if changed:
            log.info("the run's config changed: %s; training with it from this step", changed)
        if refused is not None and refused != self.refused:
            log.warning("%s", refused)
        self.followed, self.refused = followed, refused
        self.min_trained_share = run_config.get("min_trained_share")  # null: a server without it

    # ----- the loop ---------------------------------------------------------------------------

    def run(self) -> TrainerState:
        config = self.config
        progress = self.start_progress()
        tracking = self.start_tracking()
        progress.track = tracking.log
        try:
            while not self.stopping and (
                config.max_steps == 0 or self.state.step < config.max_steps
            ):
                step = self.state.step + 1
                started = time.monotonic()
                claimed = self.claim()  # 1. a batch of trainable sessions, exactly once
                if claimed is None:
                    break
                self.follow_rollbacks(claimed)  # before the batch's staleness is judged
                self.reach("claimed", step)
                claim_s = time.monotonic() - started
                batch = build_batch(claimed.sessions, self.rules(), self.baseline)  # 2. samples
                told = self.drop(claimed, batch)  # bad data: dropped with a reason, not fatal
                if not batch.samples:  # not a step: no update, no version, no record
                    self.train_nothing(claimed, batch, told, progress)
                    continue
                self.pending += claimed.claims  # settled by the next checkpoint
                self.leases.check()  # never train sessions another claim holds
                stats = self.train(batch)  # 3. proximal logprobs, PPO minibatches
                add_to_totals(self.state, batch, stats)  # the stats say what the loss masked
                self.reach("trained", step)
                try:
                    publish_s = self.publish()  # 4. the engines swap
                except VersionSuperseded as exc:  # a rollback since this step's claim
                    self.abandon_step(claimed, exc)
                    continue
                self.reach("published", step)
                self.state.step = step
                self.mark_trained(claimed.claims)  # they stop counting against admission
                saved = self.save_checkpoint_if_due()  # 5. weights, optimizer, what was consumed
                phases = Phases(claim_s, publish=publish_s, checkpoint=saved[1] if saved else 0.0)
                progress.step(self.state, batch, stats, phases, self.algorithm.temperature)  # 6.
                self.warn_if_little_trains()
                if saved:
                    self.commit_checkpoint(saved[0])  # 7. the checkpoint counts: confirm claims
            if self.pending:  # trained since the last checkpoint, or a confirm that failed
                self.commit_checkpoint(self.save_checkpoint())
            progress.stopped()  # a clean stop: the dashboard need not wait for a timeout
        finally:
            self.leases.stop()
            tracking.close()
        return self.state

    def start_progress(self) -> Progress:
        """The step records, to ``metrics.jsonl`` and to the server."""
        progress = Progress(
            self.config.max_steps,
            self.state.step,
            self.output / "metrics.jsonl",
            log_every=self.config.log_every,
            reference_kl=self.algorithm.kl_coef > 0,
        )
        progress.report = lambda record: self.server.post_step(
            self.run_id, record["step"], record["version"], record
        )
        return progress

    def train_nothing(
        self, claimed: Claimed, batch: Batch, told: set[str], progress: Progress
    ) -> None:
        """A batch whose every session was dropped: no step. It counts in the run's totals (the
        server sees them on the last step's record, posted again) and in the low-share warning,
        and its claims are confirmed now: nothing trained, so there is nothing for a checkpoint
        to cover, and while every batch trains nothing no checkpoint comes (a claim whose drop
        failed would hold its sessions, and their admission places, until one did). ``told``:
        the claims whose drops the server already took."""
        log.info("%s", nothing_to_train(batch))
        add_to_totals(self.state, batch, None)
        progress.amend_totals(self.state)
        self.warn_if_little_trains()
        for claim in claimed.claims:
            try:
                self._confirm(claim.covered(), "for a batch that trained nothing")
            except ServerError as exc:
                self.leases.hold(claim.claim_id, claim.size - len(claim.dropped))
                self.pending.append(claim)
                log.warning(
                    "could not confirm claim %s yet (the next checkpoint will): %s",
                    claim.claim_id,
                    exc,
                )
                continue
            self.confirmed.append(claim)
            if claim.claim_id not in told:  # the confirm told the server
                self.checkpoints.journal_drops(claim.claim_id, drop_tally(batch, claim.dropped))

    def start_tracking(self) -> Tracking:
        """TensorBoard, and W&B and MLflow where configured, from the step after the last
        checkpoint; they are told the config without its secrets."""
        run = RunInfo(
            run_id=self.run_id,
            output_dir=self.output,
            config={**to_dict(self.config, omit_secrets=True), "model": self.model_dir},
            first_step=self.state.step + 1,
        )
        return Tracking.start(self.config.tracking, run)

    def rules(self) -> Rules:
        return Rules(
            algorithm=self.algorithm,
            policy_version=self.state.version,
            max_staleness=self.followed.max_staleness,
            republished=[(restored, new) for restored, new in self.state.republished],
            row_limit=self.row_limit[0],
            row_limit_name=self.row_limit[1],
        )

    def reach(self, point: str, step: int) -> None:
        failpoints.reach(point, step, self.output)

    def claim(self) -> Claimed | None:
        """The run's ``batch_size`` trainable sessions (whole groups), waiting as long as it
        takes; the run's config, answered with every claim, is followed from claim to claim."""
        config = self.config
        claimed = Claimed()
        waited_since = time.monotonic()
        last_note = 0.0
        while len(claimed.sessions) < self.followed.batch_size:
            if self.stopping:
                for claim in claimed.claims:  # untrained: back to the pool
                    self.leases.let_go(claim.claim_id)
                    self.server.release(claim.claim_id)
                return None
            self.leases.renew_if_due()  # take back lapsed sessions before anyone else can
            self.leases.check()
            result = self.server.claim(
                self.run_id,
                self.followed.batch_size - len(claimed.sessions),
                config.claim_lease_s,
                self.algorithm.group_size or 1,
            )
            self.follow(result["run_config"])
            if result["sessions"]:
                claim = Claim(result["claim_id"], [s["session_id"] for s in result["sessions"]])
                self.checkpoints.journal_claim(claim.claim_id, self.state.step, claim.size)
                self.leases.hold(claim.claim_id, claim.size)
                claimed.claims.append(claim)
                claimed.sessions += result["sessions"]
                continue
            waited = time.monotonic() - waited_since
            if waited - last_note >= 30:
                last_note = waited
                log.info(
                    "waiting for trainable sessions: %d of %d (%.0fs)",
                    len(claimed.sessions),
                    self.followed.batch_size,
                    waited,
                )
            time.sleep(config.claim_wait_s)
        return claimed

    def train(self, batch: Batch) -> dict[str, Any]:
        algo = self.algorithm
        plan = plan_step(
            batch.samples,
            self.config.world_size,
            algo.ppo_minibatches,
            algo.max_tokens_per_microbatch,
        )
        per_rank = [(mbs, plan.tokens, plan.sequences, algo) for mbs in plan.per_rank]
        return combine(self.workers.call_each("train_step", per_rank))

    def drop(self, claimed: Claimed, batch: Batch) -> set[str]:
        """Tell the server now, so that dropped sessions stop counting against admission (the
        confirm after the next checkpoint repeats it). What they sampled is journalled once the
        server knows: they are never claimed again, so a restart must count them. Returns the
        claims whose drops the server took."""
        claimed.record_drops(batch.dropped)
        told: set[str] = set()
        for claim in claimed.claims:
            if not claim.dropped:
                continue
            self.leases.hold(claim.claim_id, claim.size - len(claim.dropped))  # before the drop
            try:
                self.server.drop(claim.claim_id, claim.dropped)
            except ServerError as exc:
                log.warning("could not drop sessions of claim %s yet: %s", claim.claim_id, exc)
                continue
            told.add(claim.claim_id)
            self.checkpoints.journal_drops(claim.claim_id, drop_tally(batch, claim.dropped))
        return told

    def publish(self) -> float:
        """Serve the updated weights as the next version."""
        self.state.version += 1
        return self.publisher.publish(self.state.version)

    def mark_trained(self, claims: list[Claim]) -> None:
        """Tell the server the claims' sessions trained into the version just published, so
        they stop counting against admission now (best effort: the confirm after the next
        checkpoint settles them anyway). The journal records the version first: a restart that
        follows a rollback to it or a later one confirms them."""
        self.checkpoints.journal_trained(
            self.state.version, [dataclasses.asdict(claim) for claim in claims]
        )
        for claim in claims:
            self.trained_into[claim.claim_id] = self.state.version
            try:
                self.server.trained(claim.claim_id, self.state.version)
            except ServerError as exc:
                log.warning("could not mark claim %s trained yet: %s", claim.claim_id, exc)

    def warn_if_little_trains(self) -> None:
        """Warn (every 10 steps at most) while less of what the run sampled trains than its
        ``min_trained_share``."""
        if self.min_trained_share is None:
            return
        if self.warned_at_step is not None and self.state.step - self.warned_at_step < 10:
            return
        warning = share_warning(self.state, float(self.min_trained_share))
        if warning is not None:
            log.warning("%s", warning)
            self.warned_at_step = self.state.step

    def save_checkpoint_if_due(self) -> tuple[Path, float] | None:
        """Every ``checkpoint_every`` steps and at the last: save one; where, and the seconds
        it took. The step's figures are written before it is marked complete, so a crash never
        keeps a step whose record is missing."""
        step = self.state.step
        if step % self.config.checkpoint_every and step != self.config.max_steps:
            return None
        started = time.monotonic()
        path = self.save_checkpoint()
        return path, time.monotonic() - started

    def save_checkpoint(self) -> Path:
        path = self.checkpoints.path(self.state.step)
        # Needed while claims of batches that trained nothing could not be confirmed at once
        # (`train_nothing`) and no step came since this checkpoint: its weights are these, and
        # it is committed again to cover them.
        if (path / "trainer.json").exists():
            return path
        self.workers.call("save_checkpoint", str(path))
        self.reach("checkpoint_saved", self.state.step)
        return path

    def commit_checkpoint(self, path: Path) -> None:
        """Mark the checkpoint complete, then confirm what it covers (consumed, or dropped with
        why): a restart resumes from it and settles its claims the same way."""
        self.state.baseline = self.baseline.state_dict()
        self.state.covered_claims = [claim.covered() for claim in self.pending]
        # confirmed already, but covered too: a restart must not count their drops again
        covered_confirmed = [claim.covered() for claim in self.confirmed]
        self.state.covered_claims += covered_confirmed
        consumed: Counter[int] = Counter()  # what a rollback past these versions would lose
        for claim in self.pending:
            if claim.claim_id in self.trained_into:
                consumed[self.trained_into[claim.claim_id]] += claim.size - len(claim.dropped)
        self.state.consumed_into += [[version, n] for version, n in sorted(consumed.items())]
        self.checkpoints.commit(path, self.state)
        self.reach("checkpointed", self.state.step)
        for claim in self.pending:
            self._confirm(claim.covered(), "at a checkpoint")
        self.pending, self.confirmed, self.trained_into = [], [], {}
        self.checkpoints.clear_journal()  # the checkpoint holds every republish and drop

    def _confirm(self, covered: dict[str, Any], when: str) -> None:
        claim_id = covered["claim_id"]
        self.leases.let_go(claim_id)  # first: a renewal racing the confirm must not count it lost
        result = self.server.confirm(claim_id, covered.get("dropped"))
        size = covered.get("sessions")
        if size is not None and int(result["settled"]) < size:
            raise ClaimLost(lost_message(claim_id, int(result["settled"]), size, when))

    def request_stop(self, *_: object) -> None:
        if self.stopping:
            raise KeyboardInterrupt
        log.info("stopping after this step (Ctrl-C again to stop now)")
        self.stopping = True


def nothing_to_train(batch: Batch) -> str:
    """The line a batch whose every session was dropped logs."""
    reasons = ", ".join(f"{n} {code}" for code, n in reason_codes(batch.dropped.values()).items())
    return f"nothing to train in {batch.sessions} sessions ({reasons}); not counted as a step"


def install_signal_handlers(trainer: Trainer) -> None:
    signal.signal(signal.SIGINT, trainer.request_stop)
    signal.signal(signal.SIGTERM, trainer.request_stop)


def describe_start(config: TrainConfig, trainer: Trainer) -> str:
    algo = trainer.algorithm
    return (
        f"training run {trainer.run_id} from version {trainer.state.version} "
        f"({config.world_size} worker(s), batch {config.batch_size}, "
        f"max staleness {config.max_staleness}, temperature {algo.temperature:g}, "
        f"off_temperature {algo.off_temperature}); config: {json.dumps(to_dict(config))}"
    )
