"""``featcache demo``: the main job end to end (extract, probe, retrieve, fine-tune, rank, report).

:mod:`featcache.demo.run` holds the job (:func:`run` on a :class:`DemoConfig`),
:mod:`featcache.demo.cli` its command.
"""

from featcache.demo.run import BASELINE, FT_PROTOCOL, PRETRAINED, DemoConfig, DemoSummary, run

__all__ = ["BASELINE", "FT_PROTOCOL", "PRETRAINED", "DemoConfig", "DemoSummary", "run"]
