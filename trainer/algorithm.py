"""One training step of the RL algorithm, on any `Backend`: proximal recompute, minibatches, loss.

`train_step` is the update of decoupled PPO (AReaL, arXiv 2505.24298) and of its special cases:

1. proximal: with ``algorithm.decoupled``, the logprobs of every micro-batch under the weights
   at the start of the step (pi_prox, no gradient), before any minibatch moves them;
2. the engine-vs-trainer mismatch on the tokens the step's own starting weights sampled;
3. with ``algorithm.kl_in_reward`` (REINFORCE++, arXiv 2501.03262), the KL to the reference as a
   per-token reward: every micro-batch's advantages less beta times the KL still to come in its
   row, then whitened over the whole batch (`kl_reward_advantages`); with ``algorithm.critic``
   (PPO with a learned value head), the values at the step's start and GAE along each row's
   loss tokens in their place (`gae_advantages`);
4. per PPO minibatch: per micro-batch a forward with gradient, the objective on the packed
   tokens (`LossInputs`) and, with the critic, its value loss (`value_term`), a backward; then
   one optimizer step.

The objective is whatever the table in ``trainer/objectives`` names; this module builds its
inputs and adds up its statistics. It reaches the model only through the `Backend` calls, so it
knows nothing about FSDP, torch.distributed, Ray or devices: the same step runs on the sharded
workers and on a plain float64 model in a test. It returns this worker's sums; the driver adds
the workers' (``trainer/figures.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainer.backend import Backend
from trainer.config import AlgorithmConfig
from trainer.objectives import LossInputs, policy_loss
from trainer.objectives.kl import kl_estimate
from trainer.objectives.ratios import masked_sum
from trainer.objectives.terms import aggregate
from trainer.plan import MicroBatch

WHITEN_EPS = 1e-8  # added to the batch std when advantages are whitened (OpenRLHF's order)


def train_step(
    backend: Backend,
    minibatches: Sequence[Sequence[MicroBatch]],
    tokens: Sequence[int],
    sequences: Sequence[int],
    algorithm: AlgorithmConfig,
    *,
    lr: float,
    after_proximal: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One step: the proximal logprobs, then one optimizer step per minibatch at ``lr``.

    ``tokens[i]`` and ``sequences[i]`` are the loss tokens and the rows holding any in
    minibatch ``i`` over all workers (`StepPlan`), so each micro-batch's loss is already its
    share of the whole minibatch's. Returns this worker's sums over its micro-batches (the
    objective's, named in ``trainer.objectives.STAT_NAMES``, and ``loss_sum``,
    ``mismatch_sum``, ``mismatch_tokens``; with the critic ``value_loss_sum``,
    ``value_clipped_tokens``, ``value_sum``, ``return_sum``), ``grad_norms`` (one per
    minibatch, before clipping) and the wall times ``seconds`` and ``proximal_seconds``.
    ``after_proximal`` runs once the proximal logprobs are in, before any update (the crash
    tests' ``mid_step`` point).
    """
    started = time.perf_counter()
    flat = [micro for minibatch in minibatches for micro in minibatch]
    proximal = proximal_logprobs(backend, flat, algorithm)
    backend.synchronize()
    proximal_seconds = time.perf_counter() - started
    totals: dict[str, Any] = mismatch(flat, proximal)
    targets = step_targets(backend, flat, proximal, algorithm)
    if after_proximal is not None:
        after_proximal()
    grad_norms = []
    index = 0
    for minibatch, token_count, sequence_count in zip(minibatches, tokens, sequences, strict=True):
        backend.set_lr(lr)
        backend.zero_grad()
        for micro in minibatch:
            stats = accumulate(
                backend,
                micro,
                proximal[index],
                targets.loss_algorithm,
                total_tokens=max(token_count, 1),
                total_sequences=max(sequence_count, 1),
                advantages=targets.advantages[index],
                reference=targets.references[index],
                critic=targets.critic(index),
            )
            index += 1
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        grad_norms.append(backend.step())
    backend.synchronize()
    totals["grad_norms"] = grad_norms
    totals["seconds"] = time.perf_counter() - started
    totals["proximal_seconds"] = proximal_seconds
    return totals


@dataclass(frozen=True)
class StepTargets:
    """What the step's start fixes for its minibatches, per micro-batch (None: the
    micro-batch's own advantages, the reference computed when needed, no critic)."""

    loss_algorithm: AlgorithmConfig  # the algorithm the loss sees (no KL term if in the reward)
    advantages: list[torch.Tensor | None]
    references: list[torch.Tensor | None]
    old_values: list[torch.Tensor] | None = None  # the critic's values at the step's start
    returns: list[torch.Tensor | None] | None = None  # the critic's targets

    def critic(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        if self.old_values is None or self.returns is None:
            return None
        return self.old_values[index], self.returns[index]


def step_targets(
    backend: Backend,
    micros: Sequence[MicroBatch],
    proximal: Sequence[torch.Tensor | None],
    algorithm: AlgorithmConfig,
) -> StepTargets:
    """The advantages the loss trains on where the algorithm makes them at the step's start
    (REINFORCE++'s KL in the reward; the critic's GAE), before any minibatch moves the weights."""
    unset: list[torch.Tensor | None] = [None] * len(micros)
    if algorithm.kl_in_reward:
        references = [backend.reference(micro) for micro in micros]
        return StepTargets(
            loss_algorithm=replace(algorithm, kl_coef=0.0, kl_in_reward=False),  # not in the loss
            advantages=kl_reward_advantages(backend, micros, proximal, references, algorithm),
            references=references,
        )
    if algorithm.critic:
        values = [backend.values(micro) for micro in micros]
        advantages, returns = gae_advantages(backend, micros, values, algorithm)
        return StepTargets(algorithm, advantages, unset, values, returns)
    return StepTargets(algorithm, unset, list(unset))


def proximal_logprobs(
    backend: Backend, micros: Sequence[MicroBatch], algorithm: AlgorithmConfig
) -> list[torch.Tensor | None]:
    """Logprobs under the weights at the start of the step (decoupled PPO's pi_prox); None
    each for plain PPO, where the behaviour policy is the proximal one."""
    if not algorithm.decoupled:
        return [None] * len(micros)
    return [backend.forward(micro).logprobs for micro in micros]


def mismatch(
    micros: Sequence[MicroBatch], proximal: Sequence[torch.Tensor | None]
) -> dict[str, float]:
    """Engine-vs-trainer logprob gap: the sum of |log pi_prox - log pi_behav| over the loss
    tokens the step's own starting policy sampled (there both sides ran the same weights),
    and their count. Only with decoupled PPO, where pi_prox is computed anyway."""
    gap, count = 0.0, 0.0
    for micro, prox in zip(micros, proximal, strict=True):
        if prox is None or not micro.rows:
            continue
        fresh = per_token(micro.fresh, prox)
        behaviour = per_token(micro.behaviour, prox)
        gap += float(((prox - behaviour).abs() * fresh).sum())
        count += float(fresh.sum())
    return {"mismatch_sum": gap, "mismatch_tokens": count}


def kl_reward_advantages(
    backend: Backend,
    micros: Sequence[MicroBatch],
    proximal: Sequence[torch.Tensor | None],
    references: Sequence[torch.Tensor | None],
    algorithm: AlgorithmConfig,
) -> list[torch.Tensor | None]:
    """REINFORCE++'s KL in the reward (Hu et al., arXiv 2501.03262, §3: the token reward
    r_t = 1[t = end] r(x, y) - beta KL_t, KL_t = log pi_old(a_t) / pi_ref(a_t); the advantage
    is the return-to-go, undiscounted, then normalised over the global batch), per micro-batch:

        A'_t = A_t - kl_coef * sum_{i >= t, i a loss token of t's row} KL_i
        A''_t = (A'_t - mean) / (std + WHITEN_EPS),  mean and std over every loss token of the
                step, all workers (population std; `Backend.reduce_sum`)

    A_t is the driver's advantage of t's turn (the estimator's; with reinforce_pp and one
    reward per session, the outcome normalised over the batch, so beta is in units of the
    outcome's std, not of the raw reward as in the paper). A row is one linear history of a
    session (its trained turns in order), so its later loss tokens are the future of t: the
    paper's sum to the end of the response is, for a multi-turn row, the sum to the end of the
    row. KL_i is ``kl_estimator``'s value (k1 is the paper's) of pi_old against the reference,
    pi_old the policy at the step's start: the proximal logprobs where decoupled, else the
    behaviour's (plain PPO's old policy). No gradient flows through any of it. None for an
    empty micro-batch (no loss token)."""
    assert all(reference is not None for reference in references), "kl_coef > 0 keeps a reference"
    shaped: list[torch.Tensor | None] = []
    for micro, prox, reference in zip(micros, proximal, references, strict=True):
        assert reference is not None
        if not micro.rows:
            shaped.append(None)
            continue
        mask = per_token(micro.loss_mask, reference) > 0
        old = prox if prox is not None else per_token(micro.behaviour, reference)
        kl = kl_estimate(algorithm.kl_estimator, old.detach(), reference.detach(), mask)
        rows = torch.split(kl, [len(row) for row in micro.rows])
        to_go = torch.cat([row.flip(0).cumsum(0).flip(0) for row in rows])
        penalised = per_token(micro.advantages, reference) - algorithm.kl_coef * to_go
        shaped.append(torch.where(mask, penalised, torch.zeros_like(penalised)))
    return whiten(backend, micros, shaped)


def whiten(
    backend: Backend, micros: Sequence[MicroBatch], advantages: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """(A - mean) / (std + WHITEN_EPS) on every loss token, 0 elsewhere: mean and population
    std over the loss tokens of all ``micros`` on all workers (two `Backend.reduce_sum`)."""
    like = next((a for a in advantages if a is not None), None)
    device = like.device if like is not None else torch.device("cpu")
    kept = [
        None if values is None else values[per_token(micro.loss_mask, values) > 0].double()
        for micro, values in zip(micros, advantages, strict=True)
    ]
    count_and_sum = torch.zeros(2, dtype=torch.float64, device=device)
    for values in kept:
        if values is not None:
            count_and_sum += torch.stack([values.new_tensor(values.numel()), values.sum()])
    count, total = backend.reduce_sum(count_and_sum).tolist()
    mean = total / max(count, 1.0)
    squares = torch.zeros(1, dtype=torch.float64, device=device)
    for values in kept:
        if values is not None:
            squares += ((values - mean) ** 2).sum()
    std = (float(backend.reduce_sum(squares)) / max(count, 1.0)) ** 0.5
    out: list[torch.Tensor | None] = []
    for micro, values in zip(micros, advantages, strict=True):
        if values is None:
            out.append(None)
            continue
        mask = per_token(micro.loss_mask, values) > 0
        whitened = (values - mean) / (std + WHITEN_EPS)
        out.append(torch.where(mask, whitened, torch.zeros_like(whitened)))
    return out


def gae_advantages(
    backend: Backend,
    micros: Sequence[MicroBatch],
    values: Sequence[torch.Tensor],
    algorithm: AlgorithmConfig,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per micro-batch, the critic's advantages (whitened) and returns (not whitened).

    GAE (Schulman et al., arXiv 1506.02438, eq. 16), A_t = sum_l (gamma lambda)^l delta_{t+l},
    delta_t = r_t + gamma V_{t+1} - V_t, along each row's loss tokens in order: t + 1 is the
    row's next loss token (the tokens between, a prompt or a tool's answer, are the
    environment's, not steps of the policy), and after the row's last loss token the episode
    ends (V = 0). r_t is ``micro.rewards`` (the driver puts a turn's reward on its last token).
    The return is A_t + V_t (the value loss's target); the advantages are then whitened over
    the batch (`whiten`), as PPO's common implementations do. ``values`` are the step's
    starting values (no gradient). None for an empty micro-batch."""
    gamma, lam = algorithm.gae_gamma, algorithm.gae_lambda
    advantages: list[torch.Tensor | None] = []
    returns: list[torch.Tensor | None] = []
    for micro, value in zip(micros, values, strict=True):
        if not micro.rows:
            advantages.append(None)
            returns.append(None)
            continue
        value = value.detach()
        old = value.tolist()
        rewards = [r for row in micro.rewards for r in row]
        loss_mask = [m for row in micro.loss_mask for m in row]
        flat = [0.0] * len(old)
        start = 0
        for row in micro.rows:
            following_value = following_advantage = 0.0
            for t in reversed(range(start, start + len(row))):
                if not loss_mask[t]:
                    continue
                delta = rewards[t] + gamma * following_value - old[t]
                following_advantage = delta + gamma * lam * following_advantage
                flat[t] = following_advantage
                following_value = old[t]
            start += len(row)
        out = torch.tensor(flat, dtype=value.dtype, device=value.device)
        mask = per_token(micro.loss_mask, value) > 0
        advantages.append(out)
        returns.append(torch.where(mask, out + value, torch.zeros_like(out)))
    return whiten(backend, micros, advantages), returns


def accumulate(
    backend: Backend,
    micro: MicroBatch,
    proximal: torch.Tensor | None,
    algorithm: AlgorithmConfig,
    *,
    total_tokens: int,
    total_sequences: int,
    advantages: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    critic: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> dict[str, float]:
    """Forward, objective and backward of one micro-batch; its statistics as floats.
    ``advantages`` replace the micro-batch's own (the KL-shaped or GAE ones); a ``reference``
    given is not computed again; ``critic`` is the step's starting values and the returns
    (None for an empty micro-batch) when the value loss joins the policy's."""
    bonus = algorithm.entropy_coef > 0  # else no [T, V] is kept for an entropy gradient
    forward = backend.forward(micro, grad=True, entropy="grad" if bonus else "detached")
    logprobs = forward.logprobs
    if micro.rows:
        mask = per_token(micro.loss_mask, logprobs) > 0
        behaviour = per_token(micro.behaviour, logprobs)
        if advantages is None:
            advantages = per_token(micro.advantages, logprobs)
        advantages = advantages.to(logprobs.dtype)
    else:  # the one-token stand-in row of an empty micro-batch: no loss token
        mask = torch.zeros_like(logprobs, dtype=torch.bool)
        behaviour = advantages = torch.zeros_like(logprobs)
    inputs = LossInputs(
        logprobs=logprobs,
        proximal=proximal,
        behaviour=behaviour,
        advantages=advantages,
        loss_mask=mask,
        sequence_ids=forward.sequence_ids,
        entropy=forward.entropy,
        reference=reference if reference is not None else backend.reference(micro),
        total_tokens=float(total_tokens),
        total_sequences=float(total_sequences),
    )
    loss, stats = policy_loss(inputs, algorithm)
    if critic is not None:
        value = backend.values(micro, grad=True)
        old, returns = critic  # returns None: an empty micro-batch, no loss token
        returns = torch.zeros_like(value) if returns is None else returns
        value_loss, value_stats = value_term(value, old, returns, inputs, algorithm)
        loss = loss + algorithm.value_coef * value_loss
        stats = stats | value_stats
    backend.backward(loss)
    out = {key: float(value) for key, value in stats.items()}
    out["loss_sum"] = float(loss.detach())
    return out


def value_term(
    value: torch.Tensor,
    old: torch.Tensor,
    returns: torch.Tensor,
    inputs: LossInputs,
    algorithm: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's loss, aggregated over the loss tokens as the policy's is, and its sums.

    Per token 1/2 (V - R)^2 (PPO, arXiv 1707.06347, eq. 9's L^VF, with the 1/2 of OpenAI's
    baselines), R the return; with ``value_clip`` c, 1/2 max((V - R)^2, (V_clip - R)^2),
    V_clip = V_old + clip(V - V_old, -c, c), V_old the step's starting value (baselines' ppo2).
    """
    mask = inputs.loss_mask.bool()
    error = (value - returns) ** 2
    clipped_tokens = torch.zeros((), dtype=value.dtype, device=value.device)
    if algorithm.value_clip is not None:
        bound = algorithm.value_clip
        clipped_error = (old + (value - old).clamp(-bound, bound) - returns) ** 2
        clipped_tokens = masked_sum((clipped_error > error).to(value.dtype), mask)
        error = torch.maximum(error, clipped_error)
    per_token_loss = torch.where(mask, 0.5 * error, torch.zeros_like(error))
    loss = aggregate(per_token_loss, mask, inputs, algorithm)
    stats = {
        "value_loss_sum": masked_sum(per_token_loss, mask).detach(),
        "value_clipped_tokens": clipped_tokens.detach(),
        "value_sum": masked_sum(value, mask).detach(),
        "return_sum": masked_sum(returns, mask).detach(),
    }
    return loss, stats


def per_token(rows: Sequence[Sequence[float]], like: torch.Tensor) -> torch.Tensor:
    """A micro-batch's per-token lists, concatenated as its packed tokens are, in ``like``'s
    dtype and on its device."""
    flat = [value for row in rows for value in row]
    return torch.tensor(flat, dtype=like.dtype, device=like.device)
