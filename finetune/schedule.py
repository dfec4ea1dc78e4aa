"""Fine-tuning schedules: SGD configurations, the step-wise learning rate and the seeded
batch stream. The grid's published values come from the protocol registry
(:data:`featcache.core.protocols.VTAB_SGD`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from featcache.core.protocols import VTAB_LAST_DECAY, VTAB_SGD
from featcache.core.splits import batch_positions  # the one SGD data order (shared with the probes)

__all__ = ["TrainConfig", "batch_positions", "lr_at", "make_configs", "milestones_for"]


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


def milestones_for(steps: int, last_decay: float = VTAB_LAST_DECAY) -> tuple[int, ...]:
    """Steps at which the lr is divided by 10: 1/3, 2/3 and ``last_decay`` of ``steps``."""
    return VTAB_SGD.milestones(steps, last_decay)


def lr_at(step: int, lr: float, milestones: Sequence[int]) -> float:
    """Learning rate of (0-based) ``step``: ``lr * 0.1 ** #{m in milestones: m <= step}``
    (torch ``MultiStepLR`` semantics, as the probes' SGD head)."""
    return lr * 0.1 ** sum(1 for m in milestones if m <= step)


def make_configs(
    steps: Sequence[int],
    lrs: Sequence[float],
    batch_size: int,
    *,
    last_decay: float = VTAB_LAST_DECAY,
    momentum: float = VTAB_SGD.momentum,
    weight_decay: float = 0.0,
    micro_batch: int | None = None,
) -> list[TrainConfig]:
    """The selection grid in its tie-break order: for each schedule length, for each lr."""
    return [
        TrainConfig(
            lr=float(lr),
            steps=int(s),
            batch_size=int(batch_size),
            milestones=milestones_for(int(s), last_decay),
            momentum=float(momentum),
            weight_decay=float(weight_decay),
            micro_batch=micro_batch,
        )
        for s in steps
        for lr in lrs
    ]
