"""Fine-tuning schedules: SGD configurations, the step-wise learning rate and the seeded
batch stream. The grid's published values come from the protocol registry
(:data:`featcache.protocols.VTAB_SGD`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from featcache.protocols import VTAB_SGD

__all__ = ["TrainConfig", "milestones_for", "lr_at", "batch_positions", "make_configs"]


@dataclass(frozen=True)
class TrainConfig:
    """One SGD fine-tuning configuration."""

    lr: float
    steps: int
    batch_size: int
    milestones: tuple[int, ...]
    momentum: float = VTAB_SGD.momentum
    weight_decay: float = 0.0
    micro_batch: int | None = None


def milestones_for(steps: int, last_decay: float = VTAB_SGD.last_decay) -> tuple[int, ...]:
    """Steps at which the lr is divided by 10: 1/3, 2/3 and ``last_decay`` of ``steps``."""
    return VTAB_SGD.milestones(steps, last_decay)


def lr_at(step: int, lr: float, milestones: Sequence[int]) -> float:
    """Learning rate of (0-based) ``step``: ``lr * 0.1 ** #{m in milestones: m <= step}``
    (torch ``MultiStepLR`` semantics, as the probes' SGD head)."""
    return lr * 0.1 ** sum(1 for m in milestones if m <= step)


def batch_positions(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Positions (into the ``n`` training rows) of the batch of ``step``.

    The data stream is the concatenation of seeded epoch permutations
    (``default_rng([seed, epoch]).permutation(n)``); step ``s`` takes items
    ``[s * batch_size, (s + 1) * batch_size)`` of it, so every batch is full and the order
    depends only on (seed, step): resuming at any step reproduces the stream exactly.
    """
    start = step * batch_size
    out = []
    need = batch_size
    epoch, off = divmod(start, n)
    while need:
        perm = np.random.default_rng([int(seed), int(epoch)]).permutation(n)
        take = perm[off : off + need]
        out.append(take)
        need -= take.size
        epoch, off = epoch + 1, 0
    return np.concatenate(out)


def make_configs(steps: Sequence[int], lrs: Sequence[float], batch_size: int, *,
                 last_decay: float = VTAB_SGD.last_decay, momentum: float = VTAB_SGD.momentum,
                 weight_decay: float = 0.0, micro_batch: int | None = None) -> list[TrainConfig]:
    """The selection grid in its tie-break order: for each schedule length, for each lr."""
    return [TrainConfig(lr=float(lr), steps=int(s), batch_size=int(batch_size),
                        milestones=milestones_for(int(s), last_decay), momentum=float(momentum),
                        weight_decay=float(weight_decay), micro_batch=micro_batch)
            for s in steps for lr in lrs]
