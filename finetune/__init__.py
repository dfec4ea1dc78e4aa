"""Fine-tuning stage: a backbone plus a new linear head trained on images, written as
``kind="finetune"`` rows that pair with the probes' rows (same protocol plan and seeds from
:mod:`featcache.protocols`).

Modules: :mod:`~featcache.finetune.config` (:class:`FinetuneConfig`, the stage config and
CLI flags), :mod:`~featcache.finetune.schedule` (SGD grid, lr steps, batch stream),
:mod:`~featcache.finetune.data` (splits and image pools), :mod:`~featcache.finetune.train`
(the training loop, checkpoints) and :mod:`~featcache.finetune.runner` (:func:`finetune`).
"""

from __future__ import annotations

from featcache.finetune.config import FinetuneConfig

__all__ = ["FinetuneConfig", "finetune"]


def finetune(config: FinetuneConfig):
    """Run fine-tuning (see :func:`featcache.finetune.runner.finetune`)."""
    from featcache.finetune.runner import finetune as _run

    return _run(config)
