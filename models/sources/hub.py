"""Hugging Face hub downloads through ``huggingface_hub``'s own client, into its standard cache.

Every call reads the environment when it runs (``HF_HUB_CACHE``/``HF_HOME``,
``HF_ENDPOINT``, ``HF_HUB_OFFLINE``), so one process can switch caches and endpoints; in
offline mode only the cache is read and a missing model is one line naming the command that
fetches it. The provenance of what was read: the hub revision (the snapshot's commit sha)
and the sha256 of each weight file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from featcache.errors import BackboneError, WeightsNotFoundError
from featcache.models.weights import hf_cache_dir  # the one reading of HF_HUB_CACHE/HF_HOME

__all__ = [
    "HUB_ID",
    "WEIGHT_SUFFIXES",
    "file_hashes",
    "hf_cache_dir",
    "is_offline",
    "missing",
    "revision_of",
    "snapshot",
]

#: ``ORG/NAME`` (optionally ``@REVISION``): a hub repository id
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9_./-]+)?$")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".npz")
_SNAPSHOT = re.compile(r"[/\\]snapshots[/\\]([0-9a-f]{40})[/\\]")
_TRUE = ("1", "true", "yes", "on")


def is_offline(offline: bool = False) -> bool:
    """``--offline`` or ``HF_HUB_OFFLINE=1``: read only the cache."""
    return bool(offline) or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def revision_of(path: str | os.PathLike | None) -> str | None:
    """The commit sha of the hub-cache snapshot a file lies in (``.../snapshots/<sha>/...``)."""
    m = _SNAPSHOT.search(str(path or ""))
    return m.group(1) if m else None


def file_hashes(paths: Any, root: str | os.PathLike | None = None) -> dict[str, str]:
    """``{file name (relative to root): sha256}`` of weight files, in name order."""
    from featcache.models.weights import file_sha256

    out = {}
    for p in sorted(Path(x) for x in paths):
        out[str(p.relative_to(root)) if root else p.name] = file_sha256(p)
    return out


def missing(what: str, fetch: str) -> WeightsNotFoundError:
    """The one-line offline error: what is not cached, where it looked, the fetch command."""
    return WeightsNotFoundError(
        f"{what} is not in the Hugging Face cache ({hf_cache_dir()}) and downloads are off "
        f"(--offline / HF_HUB_OFFLINE=1); on a connected machine run `featcache fetch-weights {fetch}` "
        "and copy the cache here (same HF_HOME / HF_HUB_CACHE)"
    )


def snapshot(repo_id: str, revision: str | None, *, offline: bool = False, fetch: str = "") -> Path:
    """The local snapshot folder of hub repo ``repo_id`` at ``revision`` (default ``main``):
    downloaded by ``huggingface_hub.snapshot_download`` (config, processor, tokenizer and
    safetensors/bin weights) unless cached, only the cache when offline."""
    from featcache.models import sources as S

    hub = S.require("huggingface_hub", "hf")
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"hf:{repo_id}" + (f"@{revision}" if revision else "")
    try:
        path = hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(hf_cache_dir()),
            local_files_only=is_offline(offline),
            endpoint=os.environ.get("HF_ENDPOINT") or None,
            allow_patterns=["*.json", "*.txt", "*.model", "*.safetensors", "*.bin", "*.py"],
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise BackboneError(f"{what}: no such model or revision on the hub ({first})") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise missing(what, fetch or f"--model {what}") from None
    except Exception as exc:  # network errors: httpx's and huggingface_hub's many types
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise BackboneError(f"cannot download {what} ({type(exc).__name__}: {first}); or pass --offline") from None
    return Path(path)
