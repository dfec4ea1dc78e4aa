"""Linear probes on cached features: a logistic-regression estimator with one meaning of C
on scikit-learn, torch and cuML, batched C sweeps, the published evaluation protocols and
the stage config. Entry points: :class:`LogisticProbe`, :class:`SGDProbe`, :func:`sweep_C`,
:class:`ProbeConfig` and :func:`run_probes` (protocols: :mod:`featcache.protocols`; metrics:
:mod:`featcache.metrics`).
"""

from __future__ import annotations

from featcache.probes.config import ProbeConfig
from featcache.probes.logistic import (
    DEFAULT_CS,
    LogisticProbe,
    SweepResult,
    resolve_backend,
    sweep_C,
)
from featcache.probes.sgd import SGDProbe

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


def run_probes(config: ProbeConfig):
    """Run probes from a feature cache into a results table (see :func:`featcache.probes.runner.run_probes`)."""
    from featcache.probes.runner import run_probes as _run

    return _run(config)
