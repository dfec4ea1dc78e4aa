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


class CorruptManifestError(FeatcacheError, ValueError):
    """A store's ``.featcache-manifest`` part is unreadable or fails its own digest
    (``featcache verify`` names it; ``verify --repair`` rewrites it from the documents)."""


class ProvenanceMismatchError(SchemaMismatchError):
    """Re-running into an existing key with different settings."""


class BackboneError(FeatcacheError, ValueError):
    """Unknown model name or unusable weights."""


class WeightsNotFoundError(BackboneError, FileNotFoundError):
    """Pretrained weights could not be found locally."""


class CorruptWeightsError(BackboneError):
    """A weight file's bytes do not match what its source promised (the Hugging Face blob's
    content address, torch hub's hash prefix, the installing package's RECORD); ``paths``: the
    cached files a re-fetch replaces."""

    def __init__(self, message: str, paths: tuple[str, ...] = ()):
        super().__init__(message)
        self.paths = tuple(paths)


class DataError(FeatcacheError, ValueError):
    """A data spec, path or split is unusable."""


class CacheNotWritableError(FeatcacheError, PermissionError):
    """The cache path cannot be written."""


class LockStateError(CacheNotWritableError):
    """The store's lock folder is unusable: a file where the folder belongs, or not writable."""


class NoSpaceError(FeatcacheError, OSError):
    """The disk (or quota) holding the store or a results table is full; nothing finished is lost."""

    @staticmethod
    def caused_by(exc: BaseException) -> bool:
        """Whether ``exc`` is a full disk or quota (an ``OSError`` ENOSPC/EDQUOT, or a library
        error wrapping one, such as polars' ``ComputeError: ... No space left on device``)."""
        import errno

        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        return "No space left on device" in text or "Disk quota exceeded" in text

    @classmethod
    def about(cls, path, what: str, need: int, then: str) -> NoSpaceError:
        """The one-line error: where, what was being written, about how much it needs, what to do."""
        import os
        import shutil

        probe = os.fspath(path)
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        try:
            free = f"{shutil.disk_usage(probe or '.').free:,} bytes free there"
        except OSError:
            free = "free space unknown"
        return cls(
            f"no space left on the device of {path} while writing {what} (needs about {need:,} bytes more; {free}). {then}"
        )


class ProbeError(FeatcacheError, ValueError):
    """Probe input is unusable (too few samples, a single class, non-finite features...)."""


class BackendUnavailableError(FeatcacheError, RuntimeError):
    """A requested compute backend (cuML, CUDA, faiss-gpu) is not available here."""


class ResultsError(FeatcacheError, ValueError):
    """A results table is malformed or inconsistent."""


class CorruptResultsError(ResultsError):
    """A results table's bytes fail their checksum or do not decode (damaged on disk)."""


class SplitError(DataError, ProbeError):
    """A seeded protocol split cannot be drawn (too few examples, a class too small...), or
    the splits a run reads are unusable (shared ids, a single class, unknown classes).

    Raised by :mod:`featcache.core.splits` and :mod:`featcache.core.stagerun`'s split checks, shared
    by probes and fine-tuning; it is both a
    :class:`DataError` and a :class:`ProbeError` so either stage's callers catch it."""


class ProtocolError(DataError, ProbeError):
    """An unknown or malformed protocol spec (:mod:`featcache.core.protocols`, shared by probes
    and fine-tuning; both a :class:`DataError` and a :class:`ProbeError`)."""


class ConfigError(FeatcacheError, ValueError):
    """A stage configuration value is invalid (a negative --limit, --chunk-rows 0, ...)."""


class PrecisionUnavailableError(BackendUnavailableError, ConfigError):
    """A requested precision this machine cannot compute in (bf16 on a CPU without bf16
    hardware): both a missing backend and a setting to change."""


class DependencyConflictError(FeatcacheError, ImportError):
    """Two installed distributions provide the same module (e.g. faiss-cpu and faiss-gpu)."""


class SweepError(FeatcacheError, ValueError):
    """A sweep cannot be planned or started (nothing to run, no scheduler at the address...)."""


class MetricInputError(FeatcacheError, ValueError):
    """A metric function was given arrays of the wrong shape or kind (labels, scores, ranks)."""


class UsageError(FeatcacheError, TypeError):
    """A library function was called the wrong way (a wrong argument type, a duplicate argument)."""


class NoSuchNameError(FeatcacheError, AttributeError):
    """A package has no such public name (``featcache.x.name``); ``hasattr`` is False for it."""


class InternalError(FeatcacheError, RuntimeError):
    """An invariant featcache relies on does not hold: a bug to report, not a usage error."""
