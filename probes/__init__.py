"""Linear probes on cached features: a logistic-regression estimator with one meaning of C
on scikit-learn, torch and cuML, batched C sweeps, the published evaluation protocols and
the stage config. Entry points: :class:`LogisticProbe`, :class:`SGDProbe`, :func:`sweep_C`,
:class:`ProbeConfig` and :func:`run_probes` (protocols: :mod:`featcache.core.protocols`; metrics:
:mod:`featcache.core.metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featcache.core._lazy import lazy_exports
from featcache.core.stagerun import Stage, register_stage

if TYPE_CHECKING:
    from featcache.probes.config import ProbeConfig
    from featcache.probes.logistic import DEFAULT_CS, LogisticProbe, SweepResult, resolve_backend, sweep_C
    from featcache.probes.runner import run_probes
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

#: imported on first use: `featcache --help` / `featcache extract` must not pay for
#: scikit-learn (the estimators import it at module level)
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ProbeConfig": "featcache.probes.config",
        "DEFAULT_CS": "featcache.probes.logistic",
        "LogisticProbe": "featcache.probes.logistic",
        "SweepResult": "featcache.probes.logistic",
        "resolve_backend": "featcache.probes.logistic",
        "sweep_C": "featcache.probes.logistic",
        "SGDProbe": "featcache.probes.sgd",
        "run_probes": "featcache.probes.runner",
    },
)

#: this stage's entry in the stage registry (the sweep runs its work items through it)
register_stage(Stage("probe", "featcache.probes:run_probes", "protocol", ("val_source", "task_metric")))
