"""Fine-tuning stage: a backbone plus a new linear head trained on images, written as
``kind="finetune"`` rows that pair with the probes' rows (same protocol plan and seeds from
:mod:`featcache.core.protocols`).

Modules: :mod:`~featcache.finetune.config` (:class:`FinetuneConfig`, the stage config and
CLI flags), :mod:`~featcache.finetune.schedule` (SGD grid, lr steps, batch stream),
:mod:`~featcache.finetune.data` (splits and image pools), :mod:`~featcache.finetune.train`
(the training loop, checkpoints) and :mod:`~featcache.finetune.runner` (:func:`finetune`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports
from featcache.core.stagerun import Stage, register_stage
from featcache.finetune.config import FinetuneConfig

if TYPE_CHECKING:
    from featcache.finetune.runner import finetune

__all__ = ["FinetuneConfig", "finetune"]

#: the runner imports torch on first use
__getattr__, __dir__ = lazy_exports(__name__, {"finetune": "featcache.finetune.runner"})

#: this stage's entry in the stage registry (the sweep runs its work items through it)
register_stage(
    Stage(
        "finetune",
        "featcache.finetune:finetune",
        "always",
        ("finetune_protocol", "pairs_with", "scaled", "val_source", "task_metric"),
    )
)
