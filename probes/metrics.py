"""Classification metrics of the probes: the stage-neutral :mod:`featcache.metrics`.

One implementation serves probes and fine-tuning (so a probe row and a fine-tune row
are scored identically); this module keeps the probes' import path. Tie rule: the lower
class index ranks first, as :meth:`LogisticProbe.predict` does.
"""

from __future__ import annotations

from featcache.metrics import METRICS, compute_all, ece, mean_per_class, nll, top1, top5, top_k

__all__ = ["top1", "top_k", "top5", "mean_per_class", "nll", "ece", "METRICS", "compute_all"]
