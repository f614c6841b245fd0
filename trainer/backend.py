"""What an RL algorithm asks of the machine that holds the model: the training backend.

An algorithm (``trainer/algorithm.py``) updates a policy through these few calls and nothing
else: a forward that turns a packed `MicroBatch` into per-token logprobs (and entropies), the
frozen reference model's logprobs, a backward, and an optimizer step. How the model is held
(FSDP2 shards over a torch.distributed group, one plain module in a test, bfloat16 or float64),
where it runs, and how gradients are reduced over workers are the backend's; the objective,
the proximal policy and the minibatch loop are the algorithm's.

The FSDP2 worker (``trainer/worker.py``) is the backend in training; its other duties (weight
export, broadcast to the engines, checkpoints) are the driver's business and not part of this
interface. Every call is collective on a sharded backend: each worker makes the same calls in
the same order, an empty micro-batch included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from trainer.plan import MicroBatch

# Entropy of each predicting distribution: not computed, computed without gradient (a figure,
# no [T, V] kept), or with gradient (an entropy bonus in the loss).
EntropyMode = Literal["none", "detached", "grad"]


@dataclass(frozen=True)
class Forward:
    """One micro-batch through the policy: per packed token (T of them, rows concatenated in
    order, 0 at each row's first token), on the backend's device."""

    logprobs: torch.Tensor  # (T,) log pi(token | earlier tokens of its row), at temperature
    entropy: torch.Tensor | None  # (T,) nats, as asked (EntropyMode); None for "none"
    sequence_ids: torch.Tensor  # (T,) long: which row of the micro-batch each token is in


class Backend(Protocol):
    """The calls an algorithm makes. Logits are divided by the run's sampling temperature
    before any logprob or entropy, so every logprob is comparable with the engine's."""

    def forward(
        self, micro: MicroBatch, *, grad: bool = False, entropy: EntropyMode = "none"
    ) -> Forward:
        """The current policy on ``micro``; with ``grad`` its logprobs carry the gradient (and
        the entropy too where ``entropy`` is "grad"). An empty micro-batch still runs (a row of
        one token) so that collectives line up."""
        ...

    def reference(self, micro: MicroBatch) -> torch.Tensor | None:
        """The frozen reference model's logprobs on ``micro`` (no gradient), laid out as
        `Forward.logprobs`; None when the run keeps no reference model (``kl_coef`` 0)."""
        ...

    def values(self, micro: MicroBatch, *, grad: bool = False) -> torch.Tensor:
        """The value head (``algorithm.critic``) on ``micro``, laid out as `Forward.logprobs`:
        at each token, V of the state it was sampled in (the head on the last hidden state of
        the token before it; 0 at each row's first token). With ``grad`` the value carries the
        gradient of the head and of the model under it."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradient of ``loss``, this worker's share of a sum over all workers
        (the backend undoes any averaging its gradient reduction does)."""
        ...

    def zero_grad(self) -> None:
        """Forget the accumulated gradient."""
        ...

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next `step`."""
        ...

    def step(self) -> float:
        """Clip the accumulated gradient by its global norm (the optimizer's ``grad_clip``),
        then one optimizer step; the norm before clipping (the same on every worker)."""
        ...

    def synchronize(self) -> None:
        """Wait for queued device work (so that wall times measure it)."""
        ...

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over all workers (a new tensor, on ``tensor``'s device and dtype):
        how an algorithm takes a statistic of the whole batch, e.g. REINFORCE++'s global
        advantage normalisation. A single worker returns it as it is."""
        ...
