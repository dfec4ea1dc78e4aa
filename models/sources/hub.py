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

from featcache.errors import BackboneError, CorruptWeightsError, WeightsNotFoundError
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
    "unreachable",
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


#: libraries whose errors are the network's or the hub's (huggingface_hub 2.x speaks through
#: its own httpx2/httpcore2: a connection closed without an answer is httpx2.RemoteProtocolError)
_NET_MODULES = (
    "huggingface_hub", "httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3", "urllib", "socket", "ssl",
)  # fmt: skip


def reason(exc: BaseException) -> str:
    """The innermost cause of a failed download as one short clause, never cut mid-word."""
    inner, seen = exc, {id(exc)}
    while (nxt := inner.__cause__ or inner.__context__) is not None and id(nxt) not in seen:
        inner = nxt
        seen.add(id(nxt))
    text = " ".join((str(inner).strip().splitlines() or [""])[0].split())
    first = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    if len(first) > 160:
        first = first[:160].rsplit(" ", 1)[0] + " ..."
    return f"{type(inner).__name__}: {first}" if first else type(inner).__name__


def is_network_error(exc: BaseException) -> bool:
    """Whether a failed download (or anything in its chain) is the network's or the hub's doing."""
    e: BaseException | None = exc
    for _ in range(10):
        if e is None:
            return False
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__module__.split(".")[0] in _NET_MODULES:
            return True
        e = e.__cause__ or e.__context__
    return False


def unreachable(what: str, fetch: str, exc: BaseException, endpoint: str | None = None) -> WeightsNotFoundError:
    """The one-line error of a download that failed with downloads on: the hub did not answer
    (unreachable, an HTTP error) and the cache does not hold it; what to do about each.
    ``endpoint``: the hub asked (default ``HF_ENDPOINT``, else huggingface_hub's own)."""
    if endpoint is None:
        import huggingface_hub.constants as hc

        endpoint = os.environ.get("HF_ENDPOINT") or hc.ENDPOINT
    return WeightsNotFoundError(
        f"cannot download {what}: the hub at {endpoint} did not answer as expected ({reason(exc)}) and it is not in "
        f"the Hugging Face cache ({hf_cache_dir()}); check the network (or HF_ENDPOINT) and run the command again, "
        f"or on a machine that reaches the hub run `featcache fetch-weights {fetch}` and copy the cache here "
        "(--offline reads only the cache, without waiting for the hub)"
    )


def check_reachable(repo_id: str, filename: str, what: str, fetch: str) -> None:
    """One request (huggingface_hub's ``get_hf_file_metadata``, without its retries) before a
    library's own download, which retries an unreachable hub for about a minute: a hub that
    does not answer, or answers 5xx, is :func:`unreachable` at once; any answer from the hub
    itself (a 404 the library falls back from included) lets the download go on."""
    import huggingface_hub as hh
    import huggingface_hub.constants as hc

    endpoint = os.environ.get("HF_ENDPOINT") or hc.ENDPOINT
    try:
        hh.get_hf_file_metadata(hh.hf_hub_url(repo_id, filename, endpoint=endpoint), timeout=10, endpoint=endpoint)
    except Exception as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int) and status < 500:
            return
        if is_network_error(exc):
            raise unreachable(what, fetch, exc, endpoint) from None


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
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        if is_offline(offline):
            raise missing(what, fetch or f"--model {what}") from None
        raise unreachable(what, fetch or f"--model {what}", exc) from None
    except Exception as exc:  # network errors: httpx's and huggingface_hub's many types
        raise unreachable(what, fetch or f"--model {what}", exc) from None
    if revision_of(str(path) + "/") is None or not Path(path).is_dir():
        raise _damaged_ref(repo_id, revision, what)
    return Path(path)


def _damaged_ref(repo_id: str, revision: str | None, what: str) -> CorruptWeightsError:
    """A cached ref (``refs/main``) that names no snapshot (empty, truncated): the cache is
    damaged, not the model; ``fetch-weights --force`` removes the ref and fetches it again."""
    ref = hf_cache_dir() / ("models--" + repo_id.replace("/", "--")) / "refs" / (revision or "main")
    try:
        text = ref.read_text()[:60]
    except OSError as exc:
        text = f"unreadable: {exc.strerror}"
    return CorruptWeightsError(
        f"{what}: the Hugging Face cache's {ref} is damaged (it names no snapshot: {text!r}); run "
        f"`featcache fetch-weights --model {what} --force` where the hub is reachable (or write the snapshot's "
        "commit sha into it)",
        paths=(str(ref),),
    )
