"""Exception hierarchy. Every error featcache raises derives from :class:`FeatcacheError`
and also from the closest builtin, so ``except ValueError`` keeps working for callers."""

from __future__ import annotations


class FeatcacheError(Exception):
    """Base class of all featcache errors."""


class SchemaMismatchError(FeatcacheError, ValueError):
    """On-disk metadata does not match what this featcache version (or this run) expects."""


class IncompleteStoreError(FeatcacheError, RuntimeError):
    """A feature array has unfinished or missing chunks."""


class NotInStoreError(FeatcacheError, KeyError):
    """Asked for a backbone/dataset/split the store does not hold."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class StoreBusyError(FeatcacheError, RuntimeError):
    """Another job is writing the same split or feature group of a shared store."""


class CorruptStoreError(IncompleteStoreError):
    """A chunk fails its checksum or contradicts the arrays beside it (bit rot, truncation)."""


class ProvenanceMismatchError(SchemaMismatchError):
    """Re-running into an existing key with different settings."""


class BackboneError(FeatcacheError, ValueError):
    """Unknown model name or unusable weights."""


class WeightsNotFoundError(BackboneError, FileNotFoundError):
    """Pretrained weights could not be found locally."""


class DataError(FeatcacheError, ValueError):
    """A data spec, path or split is unusable."""


class CacheNotWritableError(FeatcacheError, PermissionError):
    """The cache path cannot be written."""


class ProbeError(FeatcacheError, ValueError):
    """Probe input is unusable (too few samples, a single class, non-finite features...)."""


class BackendUnavailableError(FeatcacheError, RuntimeError):
    """A requested compute backend (cuML, CUDA, faiss-gpu) is not available here."""


class ResultsError(FeatcacheError, ValueError):
    """A results table is malformed or inconsistent."""


class CorruptResultsError(ResultsError):
    """A results table's bytes fail their checksum or do not decode (damaged on disk)."""


class SplitError(DataError, ProbeError):
    """A seeded protocol split cannot be drawn (too few examples, a class too small...).

    Raised by :mod:`featcache.splits`, shared by probes and fine-tuning; it is both a
    :class:`DataError` and a :class:`ProbeError` so either stage's callers catch it."""


class ProtocolError(DataError, ProbeError):
    """An unknown or malformed protocol spec (:mod:`featcache.protocols`, shared by probes
    and fine-tuning; both a :class:`DataError` and a :class:`ProbeError`)."""


class ConfigError(FeatcacheError, ValueError):
    """A stage configuration value is invalid (a negative --limit, --chunk-rows 0, ...)."""


class DependencyConflictError(FeatcacheError, ImportError):
    """Two installed distributions provide the same module (e.g. faiss-cpu and faiss-gpu)."""


class SweepError(FeatcacheError, ValueError):
    """A sweep cannot be planned or started (nothing to run, no scheduler at the address...)."""
