"""Linear probes on cached features: a logistic-regression estimator with one meaning of C
on scikit-learn, torch and cuML, batched C sweeps, the published evaluation protocols and
the stage config. Entry points: :class:`LogisticProbe`, :class:`SGDProbe`, :func:`sweep_C`,
:class:`ProbeConfig` and :func:`run_probes` (protocols: :mod:`featcache.protocols`; metrics:
:mod:`featcache.metrics`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from featcache.probes.config import ProbeConfig

__all__ = [
    "DEFAULT_CS",
    "LogisticProbe",
    "ProbeConfig",
    "SGDProbe",
    "SweepResult",
    "resolve_backend",
    "run_probes",
    "sweep_C",
]

#: imported on first use: `featcache --help` / `featcache extract` must not pay for
#: scikit-learn (the estimators import it at module level)
_LAZY = {
    "ProbeConfig": "featcache.probes.config",
    "DEFAULT_CS": "featcache.probes.logistic",
    "LogisticProbe": "featcache.probes.logistic",
    "SweepResult": "featcache.probes.logistic",
    "resolve_backend": "featcache.probes.logistic",
    "sweep_C": "featcache.probes.logistic",
    "SGDProbe": "featcache.probes.sgd",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_probes(config: ProbeConfig):
    """Run probes from a feature cache into a results table (see :func:`featcache.probes.runner.run_probes`)."""
    from featcache.probes.runner import run_probes as _run

    return _run(config)
