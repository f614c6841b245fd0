"""The trainer's configuration: frozen dataclasses, one YAML file, dotted ``key=value`` overrides.

Every field carries its help text in ``metadata["help"]``; ``describe()`` turns them into the
``proxrl train --help`` listing. ``load_config`` refuses unknown keys, values of the wrong type
and contradictory combinations at start, naming the field. This module knows nothing about
Ray, torch or the server; it only parses and checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.advantages import ESTIMATORS, EstimatorName, StdForm

ObjectiveName = Literal["ppo", "gspo", "sapo", "m2po"]  # OBJECTIVES keys (a test checks)


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or contradicts another."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field_name = field_name


def option(default: Any, help: str, **kwargs: Any) -> Any:
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        factory = default if callable(default) else (lambda d=default: type(d)(d))
        return field(default_factory=factory, metadata={"help": help, **kwargs})
    return field(default=default, metadata={"help": help, **kwargs})


ESTIMATOR_HELP = (
    "Advantage estimator (trainer/advantages.py; docs/architecture/trainer.md has the formulas): "
    + "; ".join(f"{name}: {spec.help}" for name, spec in ESTIMATORS.items())
    + "."
)


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL algorithm, whole: the worker receives this frozen object and the loss, the
    estimator and the staleness rule read their settings from it. Its bounds are checked when
    it is made (`check_algorithm`), so nothing downstream checks them again."""

    advantage: EstimatorName = option("grpo", ESTIMATOR_HELP)  # noqa: RUF009 (a Literal alias)
    group_size: int | None = option(
        None,
        "Sessions per GRPO group: a group is claimed once this many of its sessions are "
        "trainable, or as it is after the run's group_timeout_s (1: no waiting; a group_id "
        "group is never split either way). null: the run's `group_size` (default 1); a number "
        "is written into the run's config at start.",
    )
    discount: float = option(
        1.0, "Discount between turns of a multi-turn session (per-turn rewards), in [0, 1]."
    )
    baseline_momentum: float = option(
        0.9, "Momentum of the per-task running baseline (advantage=running), in [0, 1)."
    )
    decoupled: bool = option(
        True,
        "Decoupled PPO: clip against the recomputed proximal policy and weight by "
        "pi_prox / pi_behav. false: plain PPO, the behaviour policy is the proximal one.",
    )
    eps_clip: float = option(
        0.2, "PPO clip range below 1 (and above 1 unless eps_clip_high), in (0, 1)."
    )
    eps_clip_high: float | None = option(
        None, "PPO clip range above 1 (clip-higher), > 0; default: eps_clip."
    )
    dual_clip: float | None = option(
        None, "Dual-clip constant c > 1 for negative advantages; default: off."
    )
    behaviour_cap: float | None = option(
        5.0, "Cap (> 1) on the behaviour importance weight pi_prox / pi_behav; null: no cap."
    )
    behaviour_mode: Literal["truncate", "token_mask", "sequence_mask"] = option(
        "token_mask",
        "What the cap does: truncate the weight, or mask the token / the whole sequence.",
    )
    kl_coef: float = option(
        0.0,
        "Weight (>= 0) of the KL term to the initial (reference) policy in the loss, estimated "
        "per token by kl_estimator.",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = option(
        "k3",
        "Estimator of the KL term (Schulman 2020), with r = pi_ref / pi at the sampled token. "
        "k3 = r - 1 - log r: its value estimates KL(pi || ref), its gradient in the loss is "
        "that of KL(ref || pi) (forward KL). k2 = (log r)^2 / 2: gradient of KL(pi || ref) "
        "(reverse KL). k1 = -log r: value unbiased for KL(pi || ref), but its expected "
        "gradient in the loss is 0 (it regularises nothing; reported for comparison).",
    )
    kl_in_reward: bool = option(
        False,
        "REINFORCE++'s KL in the reward (arXiv 2501.03262): each loss token's advantage less "
        "kl_coef times the kl_estimator KL (k1 is the paper's) of the step's starting policy to "
        "the reference, summed over the row's later loss tokens, then whitened over the batch's "
        "loss tokens (all workers); the KL is then not in the loss. Needs kl_coef > 0.",
    )
    critic: bool = option(
        False,
        "PPO with a learned critic (Schulman et al. 2017, arXiv 1707.06347): a value head "
        "(a linear layer on the policy's last hidden state) trained with the policy, "
        "value_coef times its clipped squared error to the returns in the loss; the "
        "advantages are GAE (arXiv 1506.02438, eq. 16, gae_gamma and gae_lambda) over each "
        "row's loss tokens, whitened over the batch, in place of the estimator's (each turn's "
        "reward on its last token). The head is checkpointed, never published to the engines.",
    )
    value_coef: float = option(
        0.5, "critic: the value loss's weight (> 0) in the loss (PPO's c1, arXiv 1707.06347 eq. 9)."
    )
    value_clip: float | None = option(
        0.2,
        "critic: a new value may move at most this far (> 0) from the step's starting value "
        "before its error stops counting (the larger of the clipped and unclipped squared "
        "errors, as OpenAI's baselines clip it). null: unclipped.",
    )
    value_lr_scale: float = option(
        10.0,
        "critic: the value head's learning rate as a multiple (> 0) of the policy's (its "
        "warm-up too). The head starts at 0 (every value 0: GAE then starts from the returns) "
        "and is a linear read-out, which Adam moves by about its rate per weight per step: at "
        "the policy's rate it would barely move.",
    )
    gae_gamma: float = option(
        1.0, "critic: GAE's discount gamma between loss tokens, in [0, 1] (arXiv 1506.02438)."
    )
    gae_lambda: float = option(
        0.95, "critic: GAE's lambda, in [0, 1] (0: one-step TD error; 1: return less value)."
    )
    objective: ObjectiveName = option(  # noqa: RUF009 (a Literal alias)
        "ppo",
        "Policy objective (trainer/objectives/, one module each; docs/architecture/"
        "algorithms.md). ppo: decoupled PPO, token ratio and clip (AReaL). gspo: sequence-level "
        "ratio and clip (GSPO, arXiv 2507.18071). sapo: a soft sigmoid gate in place of the "
        "clip (SAPO, arXiv 2511.20347). m2po: stale tokens masked by the second moment of "
        "their log ratio, no clip (M2PO, arXiv 2510.01161).",
    )
    sapo_tau_pos: float = option(
        1.0, "objective=sapo: the gate's temperature (> 0) for tokens with positive advantage."
    )
    sapo_tau_neg: float = option(
        1.05,
        "objective=sapo: the gate's temperature (> 0) for tokens with advantage <= 0 (the "
        "paper takes it above sapo_tau_pos).",
    )
    m2po_tau: float = option(
        0.04,
        "objective=m2po: bound (> 0) on the mean of (log pi / pi_behav)^2 over the tokens "
        "kept; the tokens with the largest values are masked until it holds (paper: 0.04).",
    )
    aggregation: Literal["token_mean", "sequence_mean", "constant"] = option(
        "token_mean",
        "How per-token loss terms become the loss. token_mean: sum over the minibatch's loss "
        "tokens / their number. sequence_mean: the mean over each row's loss tokens, then over "
        "rows (GRPO, arXiv 2402.03300, eq. 3). constant: sum over a row's tokens / "
        "aggregation_constant, then the mean over rows (Dr. GRPO, arXiv 2503.20783).",
    )
    aggregation_constant: float | None = option(
        None,
        "aggregation=constant: the constant normaliser (> 0) of each row's token sum, e.g. "
        "the generation budget in tokens (Dr. GRPO uses the max answer length). Only with "
        "aggregation=constant.",
    )
    entropy_coef: float = option(
        0.0,
        "Entropy bonus (>= 0): the loss less entropy_coef times the policy's entropy over the "
        "loss tokens, aggregated as the loss is. 0: off (entropy is only reported).",
    )
    stale: Literal["keep", "mask", "drop"] = option(
        "keep",
        "Tokens sampled more than max_staleness versions before the trained one. keep: train "
        "them (as AReaL does): the server's admission bound (max_staleness) limits how far "
        "generation runs ahead, and the decoupled loss's behaviour weight pi_prox / pi_behav "
        "(capped by behaviour_cap) corrects what is stale, so a long session keeps its early "
        "turns. mask: mask them out of the loss (this leans training toward late turns and "
        "short sessions). drop: drop the whole session (with a reason the server shows). "
        "Under each, the staleness of every trained token is recorded.",
    )
    dynamic_sampling: bool = option(
        False,
        "Dynamic sampling (DAPO): leave out sessions whose every trained advantage is 0 (a "
        "group with no contrast, or the survivor of a group whose other members were dropped) "
        "from the batch and from the loss's token denominator; each counts as a dropped session "
        "with reason no_contrast. Not with advantage=running, whose zeros are rare "
        "coincidences, not groups without contrast (sessions without group or task key, which "
        "the running baseline serves, are kept for the same reason).",
    )
    ppo_minibatches: int = option(1, "PPO minibatches (optimizer steps) per training step.")
    max_tokens_per_microbatch: int = option(
        4096,
        "Token budget of one packed (padding-free) micro-batch on a worker. A longer row "
        "(up to max_tokens_per_row) gets a micro-batch of its own.",
    )
    max_tokens_per_row: int | None = option(
        None,
        "Longest row trained; a session with a longer row is dropped with a reason. null: the "
        "model's context length (max_position_embeddings in its config.json).",
    )
    temperature: float | None = option(
        None,
        "Training temperature: the proximal (and current) logprobs are those of "
        "softmax(logits / temperature). null: the run's `temperature` on the server (default "
        "1.0); a number is written into the run's config at start, so the server samples "
        "requests that give no temperature at it. One value for both: the trainer follows the "
        "run's from step to step (a PATCH of the run takes effect at the next step).",
    )
    off_temperature: Literal["mask", "off_policy"] | None = option(
        None,
        "Turns sampled at another temperature than the training one: mask them out of the "
        "loss, or train them off-policy with the behaviour logprob of the distribution they "
        "were drawn from, capped like every behaviour weight. Greedy turns (temperature 0) are "
        "masked under both: argmax is a point mass, which no importance weight corrects. null: "
        "the run's `off_temperature` (default mask); a value is written into the run's config "
        "at start.",
    )
    # --- rewards into advantages: the std's form, reward shaping, DAPO's overlong rules ---
    advantage_std: StdForm = option(  # noqa: RUF009 (a Literal alias)
        "population",
        "The std of the estimators that divide by one (grpo, reinforce_pp, lite_ppo, "
        "reinforce_pp_baseline): population (over N, GRPO's paper) or sample (Bessel's N - 1, "
        "as TRL and verl compute it).",
    )
    reward_scale: float = option(
        1.0,
        "Every reward (each turn's, with its overlong penalty, and the session's) is "
        "multiplied by this (> 0) before returns are computed; then clipped (reward_clip).",
    )
    reward_clip: float | None = option(
        None,
        "Clip every reward to [-reward_clip, reward_clip] (> 0) after reward_scale, so the bound "
        "is in the units the returns use whatever the scale. null: no clip.",
    )
    overlong_filter: bool = option(
        False,
        "DAPO's overlong filtering (arXiv 2503.14476): the tokens of a turn cut by the length "
        "limit (finish_reason length) are masked out of the loss, counted as masked tokens "
        "with cause overlong; the session's other turns still train (a session with nothing "
        "left is dropped, with the reason).",
    )
    overlong_max_tokens: int | None = option(
        None,
        "DAPO's soft overlong punishment (eq. 13): L_max, the answer length in tokens beyond "
        "which a turn's reward gets -1. With overlong_cache_tokens; null: off.",
    )
    overlong_cache_tokens: int | None = option(
        None,
        "DAPO's soft overlong punishment: L_cache, the window below overlong_max_tokens where "
        "the penalty falls linearly from 0 to -1 ((L_max - L_cache - |y|) / L_cache), in "
        "[1, overlong_max_tokens]. The penalty is added to the turn's own reward before "
        "reward_scale and reward_clip.",
    )

    def __post_init__(self) -> None:
        check_algorithm(self)


@dataclass(frozen=True)
class OptimConfig:
    weight_decay: float = option(0.0, "AdamW weight decay.")
    beta1: float = option(0.9, "AdamW beta1.")
    beta2: float = option(0.999, "AdamW beta2.")
    eps: float = option(1e-8, "AdamW epsilon.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this (0: off).")
    warmup_steps: int = option(0, "Linear learning-rate warm-up over this many steps.")


@dataclass(frozen=True)
class ClusterConfig:
    address: str | None = option(
        None, "Ray cluster to join (ray.init(address=...)); default: a local Ray on this machine."
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "Where workers train: auto picks cuda when Ray gives them a GPU."
    )
    cpus_per_worker: float = option(1.0, "CPUs Ray reserves for each worker.")
    threads_per_worker: int = option(0, "torch threads per worker (0: cpus_per_worker).")
    auth: Literal["token", "none"] = option(
        "token",
        "With `address`: token joins with Ray's token authentication (RAY_AUTH_MODE=token; the "
        "cluster must run with it too); none joins a cluster that runs without it. A local Ray "
        "always uses a token of its own.",
    )
    auth_token_file: str | None = option(
        None,
        "With `address` and auth=token: file holding the cluster's token (default: "
        "$RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token, as Ray reads them).",
    )


@dataclass(frozen=True)
class PublishConfig:
    mode: Literal["disk", "distributed"] = option(
        "disk",
        "disk: write safetensors and POST /admin/weights; distributed: broadcast the weights "
        "to the engines over a torch.distributed group (the engines must reach this machine).",
    )
    keep_versions: int = option(3, "Weight directories kept on disk (older ones are removed).")
    timeout_s: float = option(600.0, "Timeout of one publish call to the server.")
    master_address: str = option(
        "127.0.0.1",
        "distributed: address the engines use to reach the trainer's group (rank 0 hosts it); "
        "empty: the address of the node rank 0 runs on (its Ray node address).",
    )


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA run (Hu et al. 2021, arXiv 2106.09685): the base model frozen, each target
    Linear's output plus scale * B A x, only A and B trained, checkpointed and published."""

    rank: int = option(8, "The adapter's rank r (>= 1): A is r x in, B is out x r.")
    alpha: float = option(
        16.0,
        "LoRA's alpha (> 0): the adapter's delta is scaled by alpha / rank (alpha / sqrt(rank) "
        "with use_rslora).",
    )
    target_modules: tuple[str, ...] = option(
        (),
        "Names (suffixes of module paths, e.g. q_proj, down_proj) of the Linear modules that get "
        "an adapter; each must name a Linear inside the model's decoder layers. Empty: every "
        "Linear of the decoder layers (the attention and MLP projections the model has).",
    )
    dropout: float = option(
        0.0,
        "Dropout on the adapter's input, in [0, 1), applied in the forward that takes the "
        "gradient only: the proximal, reference and published policies are the adapter without "
        "it (the behaviour policy, the engine, has none either).",
    )
    use_rslora: bool = option(
        False, "Rank-stabilised LoRA (arXiv 2312.03732): scale by alpha / sqrt(rank)."
    )

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError("lora.rank", f"must be >= 1, got {self.rank}")
        if not 0 < self.alpha < math.inf:
            raise ConfigError("lora.alpha", f"must be > 0 and finite, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("lora.dropout", f"must be in [0, 1), got {self.dropout}")
        if any(not name.strip() for name in self.target_modules):
            raise ConfigError("lora.target_modules", "holds an empty name")


@dataclass(frozen=True)
class WandbConfig:
    project: str | None = option(
        None,
        "Weights & Biases project: set it to log every step there (pip install "
        "'proxrl[wandb]'; the API key comes from WANDB_API_KEY or `wandb login`). null: off.",
    )
    entity: str | None = option(None, "W&B entity (team or user); default: yours.")
    name: str | None = option(None, "W&B run name; default: the proxrl run id.")
    mode: Literal["online", "offline"] = option(
        "online", "online: send as it trains; offline: write only (`wandb sync` sends later)."
    )
    tags: tuple[str, ...] = option((), "W&B run tags, a list.")


@dataclass(frozen=True)
class MlflowConfig:
    tracking_uri: str | None = option(
        None,
        "MLflow tracking server or store (http://host:5000, sqlite:///path/mlflow.db, "
        "file:///path/mlruns): set it to log every step there (pip install 'proxrl[mlflow]'). "
        "null: off.",
    )
    experiment: str = option("proxrl", "MLflow experiment (made if missing).")
    run_name: str | None = option(None, "MLflow run name; default: the proxrl run id.")


@dataclass(frozen=True)
class TrackingConfig:
    """Where every step's figures go besides metrics.jsonl (trainer/tracking.py)."""

    tensorboard: bool = option(True, "Write TensorBoard event files.")
    tensorboard_dir: str | None = option(
        None, "Directory of the TensorBoard event files; default: <output_dir>/tensorboard."
    )
    wandb: WandbConfig = field(
        default_factory=WandbConfig, metadata={"help": "Weights & Biases (off unless `project`)."}
    )
    mlflow: MlflowConfig = field(
        default_factory=MlflowConfig, metadata={"help": "MLflow (off unless `tracking_uri`)."}
    )


@dataclass(frozen=True)
class TrainConfig:
    server: str = option(
        "", "URL of a running `proxrl serve` (empty with `model`: start one here)."
    )
    admin_key: str = option("", "The server's admin key (default: $PROXRL_ADMIN_KEY).", secret=True)
    run_id: str | None = option(None, "The run to train (default: the server's default run).")
    model: str | None = option(
        None,
        "The model directory the run serves. With no `server`, proxrl starts `proxrl serve` "
        "on it for a one-command local run; otherwise it is read from the server.",
    )
    output_dir: str = option("train-out", "Weights, checkpoints and logs go here.")
    batch_size: int = option(8, "Sessions per training step.")
    max_steps: int = option(
        100, "Training steps to run (across restarts); 0: until stopped (Ctrl-C or SIGTERM)."
    )
    max_staleness: int = option(
        1,
        "Versions a sampled token may lag behind the policy it trains (0: synchronous). "
        "Sent to the server, which admits sessions by the same bound.",
    )
    world_size: int = option(1, "FSDP2 workers (Ray actors) that train together.")
    lr: float = option(1e-5, "Learning rate (AdamW).")
    seed: int = option(0, "Seed of the workers' random state.")
    checkpoint_every: int = option(10, "Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = option(2, "Checkpoints kept on disk.")
    claim_wait_s: float = option(
        1.0, "How long to wait between claims while too few sessions are trainable."
    )
    claim_lease_s: float = option(
        300.0,
        "Lease of a claim: the trainer renews every claim it holds (a quarter of the lease "
        "apart, from a thread of its own) until a checkpoint covers it and it is confirmed; "
        "a dead trainer's claims return to the pool after this long (or when it restarts).",
    )
    request_timeout_s: float = option(60.0, "Timeout of each call to the server.")
    log_every: int = option(
        1,
        "Print the progress line every N steps (and on the last); every step's figures still "
        "go to metrics.jsonl and the server.",
    )
    algorithm: AlgorithmConfig = field(
        default_factory=AlgorithmConfig, metadata={"help": "The RL algorithm."}
    )
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "The optimizer."})
    cluster: ClusterConfig = field(
        default_factory=ClusterConfig, metadata={"help": "Where the workers run."}
    )
    publish: PublishConfig = field(
        default_factory=PublishConfig, metadata={"help": "How new weights reach the engines."}
    )
    tracking: TrackingConfig = field(
        default_factory=TrackingConfig,
        metadata={"help": "Experiment tracking: TensorBoard, Weights & Biases, MLflow."},
    )
    lora: LoraConfig | None = field(
        default=None,
        metadata={
            "help": "Train a LoRA adapter on the frozen base model instead of its full weights "
            "(any lora.* option, or `lora: {}`, turns it on); absent: a full-weight run. "
            "Checkpoints and publishes hold the adapter only (docs/architecture/trainer.md, "
            "LoRA runs)."
        },
    )

    def __post_init__(self) -> None:
        check(self)


def _positive(value: float, name: str) -> None:
    if not value > 0:
        raise ConfigError(name, f"must be > 0, got {value}")


def check(config: TrainConfig) -> None:  # noqa: C901, PLR0912  # a flat list of field checks
    """Ranges and contradictions across fields, each failing with the field it is about (the
    algorithm's own bounds are checked when it is made: `check_algorithm`)."""
    for name in ("batch_size", "world_size", "checkpoint_every", "log_every"):
        _positive(getattr(config, name), name)
    if config.max_steps < 0:
        raise ConfigError("max_steps", f"must be >= 0 (0: until stopped), got {config.max_steps}")
    _positive(config.lr, "lr")
    _positive(config.request_timeout_s, "request_timeout_s")
    _positive(config.claim_lease_s, "claim_lease_s")
    if config.max_staleness < 0:
        raise ConfigError("max_staleness", f"must be >= 0, got {config.max_staleness}")
    if config.keep_checkpoints < 1:
        raise ConfigError("keep_checkpoints", "must be >= 1")
    if config.claim_wait_s < 0:
        raise ConfigError("claim_wait_s", "must be >= 0")
    if not config.server and not config.model:
        raise ConfigError("server", "give the URL of a running server, or `model` to start one")
    algo = config.algorithm
    if algo.group_size is not None and config.batch_size % algo.group_size:
        raise ConfigError(
            "algorithm.group_size",
            f"batch_size {config.batch_size} must be a multiple of group_size {algo.group_size}",
        )
    if algo.ppo_minibatches > config.batch_size:
        raise ConfigError("algorithm.ppo_minibatches", "must be <= batch_size")
    if config.optim.grad_clip < 0:
        raise ConfigError("optim.grad_clip", "must be >= 0 (0: off)")
    if config.optim.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", "must be >= 0")
    if config.optim.weight_decay < 0:
        raise ConfigError("optim.weight_decay", "must be >= 0")
    _positive(config.cluster.cpus_per_worker, "cluster.cpus_per_worker")
    if config.cluster.threads_per_worker < 0:
        raise ConfigError("cluster.threads_per_worker", "must be >= 0")
    check_cluster_auth(config.cluster)
    if config.publish.keep_versions < 1:
        raise ConfigError("publish.keep_versions", "must be >= 1")
    _positive(config.publish.timeout_s, "publish.timeout_s")
    check_tracking(config.tracking)
    check_lora(config)


def check_lora(config: TrainConfig) -> None:
    """What a LoRA run cannot do yet, refused at start (the adapter's own bounds are checked
    when it is made; its targets against the model in ``trainer/model.py``)."""
    if config.lora is None:
        return
    if config.publish.mode == "distributed":
        raise ConfigError(
            "publish.mode",
            "distributed does not take a LoRA run yet (the engines' weight group receives "
            "full weights); use publish.mode=disk, which writes the adapter alone",
        )


def check_tracking(tracking: TrackingConfig) -> None:
    """A tracker's settings mean nothing while it is off: refuse them rather than ignore them."""
    if tracking.tensorboard_dir is not None and not tracking.tensorboard:
        raise ConfigError("tracking.tensorboard_dir", "needs tracking.tensorboard: true")
    _needs(tracking.wandb, "project", WandbConfig(), "tracking.wandb.")
    _needs(tracking.mlflow, "tracking_uri", MlflowConfig(), "tracking.mlflow.")
    _check_choices(tracking.wandb, "tracking.wandb.")


def _needs(config: Any, switch: str, defaults: Any, prefix: str) -> None:
    """Every field of ``config`` left at its default unless ``switch`` is set."""
    if getattr(config, switch):
        return
    for f in dataclasses.fields(config):
        if getattr(config, f.name) != getattr(defaults, f.name):
            raise ConfigError(prefix + f.name, f"needs {prefix}{switch} (the tracker is off)")


def check_cluster_auth(cluster: ClusterConfig) -> None:
    """Authentication settings only mean something when joining a cluster."""
    if not cluster.address and cluster.auth != "token":
        raise ConfigError(
            "cluster.auth", "applies to a cluster `address` (a local Ray uses a token)"
        )
    if cluster.auth_token_file is not None:
        if not cluster.address or cluster.auth != "token":
            raise ConfigError("cluster.auth_token_file", "needs cluster.address and auth=token")
        if not Path(cluster.auth_token_file).is_file():
            raise ConfigError("cluster.auth_token_file", "is not a file")


def check_algorithm(algo: AlgorithmConfig) -> None:  # noqa: C901, PLR0912  # a flat list of bounds
    """Every bound the loss, the estimators and the batching rely on, in one place: the loss
    does not check them again."""
    name = "algorithm."
    _check_choices(algo, name)
    if algo.group_size is not None:
        _positive(algo.group_size, name + "group_size")
    if not 0 <= algo.discount <= 1:
        raise ConfigError(name + "discount", f"must be in [0, 1], got {algo.discount}")
    if not 0 <= algo.baseline_momentum < 1:
        raise ConfigError(name + "baseline_momentum", "must be in [0, 1)")
    if not 0 < algo.eps_clip < 1:
        raise ConfigError(name + "eps_clip", f"must be in (0, 1), got {algo.eps_clip}")
    if algo.eps_clip_high is not None:
        _positive(algo.eps_clip_high, name + "eps_clip_high")
    if algo.dual_clip is not None and algo.dual_clip <= 1:
        raise ConfigError(name + "dual_clip", "must be > 1 (or null)")
    if algo.behaviour_cap is not None and algo.behaviour_cap <= 1:
        raise ConfigError(name + "behaviour_cap", "must be > 1 (or null for no cap)")
    if not algo.kl_coef >= 0:
        raise ConfigError(name + "kl_coef", "must be >= 0")
    if algo.kl_in_reward and algo.kl_coef == 0:
        raise ConfigError(name + "kl_in_reward", "needs kl_coef > 0 (the KL's weight beta)")
    check_critic(algo)
    if not 0 <= algo.entropy_coef < math.inf:
        raise ConfigError(name + "entropy_coef", f"must be >= 0, got {algo.entropy_coef}")
    if (algo.aggregation == "constant") != (algo.aggregation_constant is not None):
        raise ConfigError(
            name + "aggregation_constant",
            "is needed with aggregation=constant, and only there",
        )
    if algo.aggregation_constant is not None and not 0 < algo.aggregation_constant < math.inf:
        raise ConfigError(
            name + "aggregation_constant",
            f"must be > 0 and finite, got {algo.aggregation_constant}",
        )
    for field_name in ("sapo_tau_pos", "sapo_tau_neg", "m2po_tau"):
        value = getattr(algo, field_name)
        if not 0 < value < math.inf:
            raise ConfigError(name + field_name, f"must be > 0 and finite, got {value}")
    defaults = AlgorithmConfig.__dataclass_fields__
    for field_name in ("sapo_tau_pos", "sapo_tau_neg", "m2po_tau"):
        owner = field_name.split("_")[0]
        if algo.objective != owner and getattr(algo, field_name) != defaults[field_name].default:
            raise ConfigError(name + field_name, f"applies only to objective={owner}")
    _positive(algo.ppo_minibatches, name + "ppo_minibatches")
    _positive(algo.max_tokens_per_microbatch, name + "max_tokens_per_microbatch")
    if algo.max_tokens_per_row is not None:
        _positive(algo.max_tokens_per_row, name + "max_tokens_per_row")
    if algo.temperature is not None and not 0 < algo.temperature <= 2:
        raise ConfigError(name + "temperature", f"must be in (0, 2], got {algo.temperature}")
    if algo.dynamic_sampling and algo.advantage == "running":
        raise ConfigError(
            name + "dynamic_sampling",
            "does nothing under advantage=running (no groups: a 0 is a coincidence, not a "
            "group without contrast); use a group estimator or turn it off",
        )
    check_rewards(algo)


# Options the critic's GAE replaces or cannot take, refused beside it (each at its default
# otherwise): what each would do is done differently there, or not at all.
NOT_WITH_CRITIC = {
    "discount": "does nothing under critic: true (GAE discounts per token by gae_gamma)",
    "advantage_std": "does nothing under critic: true (GAE's advantages are whitened over "
    "the batch, not divided by the estimator's std)",
    "kl_in_reward": "not with critic: true (GAE takes no KL reward yet)",
    "dynamic_sampling": "not with critic: true (it drops the sessions whose group estimator's "
    "advantages are all 0, but the critic's advantages come from GAE: those sessions would "
    "be dropped while they still carry a signal)",
}


def check_critic(algo: AlgorithmConfig) -> None:
    """The learned critic's bounds; its options only with ``critic``, and the options it
    replaces (`NOT_WITH_CRITIC`) not with it."""
    name = "algorithm."
    defaults = AlgorithmConfig.__dataclass_fields__
    for field_name in ("value_coef", "value_clip", "value_lr_scale", "gae_gamma", "gae_lambda"):
        if not algo.critic and getattr(algo, field_name) != defaults[field_name].default:
            raise ConfigError(name + field_name, "applies only with critic: true")
    _check_critic_bounds(algo)
    for field_name, why in NOT_WITH_CRITIC.items():
        if algo.critic and getattr(algo, field_name) != defaults[field_name].default:
            raise ConfigError(name + field_name, why)


def _check_critic_bounds(algo: AlgorithmConfig) -> None:
    name = "algorithm."
    for field_name in ("value_coef", "value_lr_scale"):
        value = getattr(algo, field_name)
        if not 0 < value < math.inf:
            raise ConfigError(name + field_name, f"must be > 0 and finite, got {value}")
    if algo.value_clip is not None and not 0 < algo.value_clip < math.inf:
        raise ConfigError(name + "value_clip", f"must be > 0 and finite, got {algo.value_clip}")
    for field_name in ("gae_gamma", "gae_lambda"):
        if not 0 <= getattr(algo, field_name) <= 1:
            raise ConfigError(
                name + field_name, f"must be in [0, 1], got {getattr(algo, field_name)}"
            )


def check_rewards(algo: AlgorithmConfig) -> None:
    """The bounds of the settings that turn rewards into advantages."""
    name = "algorithm."
    if algo.advantage_std != "population" and not ESTIMATORS[algo.advantage].uses_std:
        raise ConfigError(
            name + "advantage_std",
            f"does nothing under advantage={algo.advantage} (it divides by no std)",
        )
    if not 0 < algo.reward_scale < math.inf:
        raise ConfigError(name + "reward_scale", f"must be > 0 and finite, got {algo.reward_scale}")
    if algo.reward_clip is not None and not 0 < algo.reward_clip < math.inf:
        raise ConfigError(name + "reward_clip", f"must be > 0 and finite, got {algo.reward_clip}")
    longest, cache = algo.overlong_max_tokens, algo.overlong_cache_tokens
    if (longest is None) != (cache is None):
        raise ConfigError(
            name + ("overlong_cache_tokens" if cache is None else "overlong_max_tokens"),
            "the soft overlong penalty needs both overlong_max_tokens and overlong_cache_tokens",
        )
    if longest is not None and cache is not None:
        _positive(longest, name + "overlong_max_tokens")
        if not 1 <= cache <= longest:
            raise ConfigError(
                name + "overlong_cache_tokens",
                f"must be in [1, overlong_max_tokens ({longest})], got {cache}",
            )


def _check_choices(config: Any, prefix: str) -> None:
    """Fields typed as a Literal hold one of its values (also when made in Python, not YAML)."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        hint, value = hints[f.name], getattr(config, f.name)
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            if value is None and type(None) in typing.get_args(hint):
                continue
            hint = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if typing.get_origin(hint) is Literal and value not in typing.get_args(hint):
            allowed = ", ".join(repr(a) for a in typing.get_args(hint))
            raise ConfigError(prefix + f.name, f"must be one of {allowed}, got {value!r}")


# --- loading ---------------------------------------------------------------------------------


def nested_class(hint: Any) -> type | None:
    """The dataclass of a group of options (``X`` or ``X | None``: a group that may be
    absent), else None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        present = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = present[0] if len(present) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _coerce(value: Any, hint: Any, name: str) -> Any:  # noqa: C901, PLR0912  # a case per kind of hint
    """``value`` checked against the type ``hint`` (ints widen to floats, nothing else)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            allowed = ", ".join(repr(a) for a in typing.get_args(hint))
            raise ConfigError(name, f"must be one of {allowed}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, name)
            except ConfigError:
                continue
        raise ConfigError(name, f"got {value!r}, which is none of the allowed types")
    if origin is tuple:  # tuple[str, ...]: a YAML list of strings
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(name, f"must be a list of strings, got {value!r}")
        return tuple(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as text
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"must be a string, got {value!r}")
        return value
    raise ConfigError(name, f"unsupported type {hint!r}")  # a bug in this module


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(name, f"unknown option (known here: {known})")
        nested = nested_class(hints[key])
        if nested is not None and value is None and fields[key].default is None:
            kwargs[key] = None  # an optional group, absent
        elif nested is not None:
            if not isinstance(value, dict):
                raise ConfigError(name, "must be a mapping of its fields")
            kwargs[key] = _build(nested, value, f"{name}.")
        else:
            kwargs[key] = _coerce(value, hints[key], name)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` → (["a", "b"], value parsed as YAML: 3, 0.1, true, null, text)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(text, "an override is key=value, e.g. algorithm.eps_clip=0.3")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def merge_override(values: dict[str, Any], path: list[str], value: Any) -> None:
    target = values
    for part in path[:-1]:
        existing = target.setdefault(part, {})
        if not isinstance(existing, dict):
            raise ConfigError(".".join(path), f"{part} is not a group of options")
        target = existing
    target[path[-1]] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config from an optional YAML file, then each ``key=value`` in order."""
    values: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(str(path), "the YAML file must be a mapping of options")
        values = loaded
    for text in overrides:
        merge_override(values, *parse_override(text))
    values.setdefault("admin_key", os.environ.get("PROXRL_ADMIN_KEY", ""))
    return _build(TrainConfig, values)


def to_dict(config: Any, omit_secrets: bool = False) -> dict[str, Any]:
    """The config as plain data, for logs and checkpoints: secrets masked, or left out
    (``omit_secrets``: what goes to an experiment tracker)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value, omit_secrets)
        elif f.metadata.get("secret"):
            if not omit_secrets:
                out[f.name] = "***" if value else value
        else:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def describe(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """One line per field: dotted name, type, default, help."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested = nested_class(hints[f.name])
        if nested is not None:
            lines.append(f"{prefix}{f.name}.*: {f.metadata['help']}")
            lines += describe(nested, f"{prefix}{f.name}.")
            continue
        default = "" if f.metadata.get("secret") else f"={_show(f.default)}"
        kind = _type_name(hints[f.name])
        lines.append(f"  {prefix}{f.name} ({kind}{default}): {f.metadata['help']}")
    return lines


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(value) + "]"
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return "list"
    if typing.get_origin(hint) is Literal:
        return "|".join(str(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    return getattr(hint, "__name__", str(hint))
