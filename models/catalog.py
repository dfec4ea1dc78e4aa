"""Model names each installed source offers, whether their weights are cached, and fetching
them ahead of time (``featcache models``, ``featcache fetch-weights``).

Names come from each library's own listing (timm's ``list_pretrained``, open_clip's
``list_pretrained``, torchvision's ``list_models`` and weights enums, the models in the
Hugging Face hub cache). Fetching builds each backbone once through its library's own client
(so everything the model needs lands in that library's standard cache) and writes a manifest
of what was fetched: the revision and the sha256 of each weight file. ``verify`` rebuilds
them offline and compares the bytes' sha256 with the manifest.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from featcache.errors import BackboneError, ConfigError, CorruptWeightsError, ProvenanceMismatchError

logger = logging.getLogger(__name__)

__all__ = ["ModelEntry", "fetch", "list_models", "read_list", "verify"]


@dataclass(frozen=True)
class ModelEntry:
    """One name a user can type: ``--model model --weights weights``; ``cached``: its weights
    are in the local cache (None: not known without reading the network)."""

    source: str
    model: str
    weights: str
    cached: bool | None


def list_models(pattern: str = "*", sources: Sequence[str] | None = None) -> Iterator[ModelEntry]:
    """Every name matching ``pattern`` (fnmatch, case-insensitive) of the installed ``sources``
    (default: every source with a listing, :data:`~featcache.models.sources.LISTINGS`)."""
    from featcache.models.sources import LISTINGS

    pat = pattern.lower()
    for s in sources or list(LISTINGS):
        if s not in LISTINGS:
            raise ConfigError(LISTINGS.unknown(s, what="--source", known="choose from"))
        try:
            rows = list(LISTINGS[s]())
        except ImportError:
            logger.info("model source %s is not installed; skipped", s)
            continue
        for model, weights, cached in rows:
            if fnmatch.fnmatch(f"{model} {weights}".lower(), f"*{pat}*" if "*" not in pat else pat) or fnmatch.fnmatch(
                model.lower(), pat
            ):
                yield ModelEntry(s, model, weights, cached)


# --------------------------------------------------------------------------- fetch / verify
def read_list(path: str) -> list[tuple[str, str]]:
    """``MODEL [WEIGHTS]`` per line (``#`` comments); WEIGHTS defaults to the source's own."""
    out = []
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise ConfigError(
            f"cannot read --list {path!r} ({why}); give a text file with 'MODEL [WEIGHTS]' per line"
        ) from None
    for n, line in enumerate(text.splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) > 2:
            raise ConfigError(f"{path}:{n}: expected 'MODEL [WEIGHTS]', got {line.strip()!r}")
        out.append((parts[0], parts[1] if len(parts) == 2 else default_weights(parts[0])))
    return out


def default_weights(model: str) -> str:
    """The weights a bare model name fetches, by its source's registration (timm's
    ``pretrained``, hf's own, torchvision's DEFAULT; a source without a default: a ConfigError)."""
    from featcache.models.sources import parse_model, source_rules

    return source_rules(parse_model(model)[0]).default_weights(model)


def _record(bb: Any, model: str, weights: str) -> dict[str, Any]:
    dc = bb.data_config
    return {
        "model": model,
        "weights": weights,
        "weights_sha256": bb.weights_sha256,
        "weights_file": bb.weights_file,
        "revision": dc.get("revision"),
        "weight_files": dc.get("weight_files") or {},
        "library": dc.get("library"),
        "library_version": dc.get("library_version"),
    }


def _fetch_one(model: str, weights: str, force: bool) -> Any:
    """The backbone, downloaded where not cached; a cached file that fails its source's
    promise (:class:`CorruptWeightsError`) is removed and fetched again with ``force``."""
    from featcache.models.backbones import create_backbone

    try:
        return create_backbone(model, weights, device="cpu")
    except CorruptWeightsError as exc:
        if not (force and exc.paths):
            raise
        for p in exc.paths:
            logger.warning("removing %s (it failed its sha256 check); fetching it again", p)
            Path(p).unlink(missing_ok=True)
    return create_backbone(model, weights, device="cpu")


def fetch(
    items: Sequence[tuple[str, str]], manifest: str | None = None, *, force: bool = False
) -> list[dict[str, Any]]:
    """Build each ``(model, weights)`` once through its library's client (downloading what is
    not cached, each file checked against what its source promised); write the manifest (JSON
    list) if given, only after every entry passed. ``force``: replace cached files that fail
    the check by a new download."""
    if manifest:
        _check_writable(manifest)  # before anything is downloaded
    records = []
    for model, weights in items:
        bb = _fetch_one(model, weights, force)
        records.append(_record(bb, model, weights))
        logger.info("fetched %s (%s): sha256 %s", model, weights, bb.weights_sha256[:12])
    if manifest:
        try:
            Path(manifest).write_text(json.dumps(records, indent=1) + "\n")
        except OSError as exc:
            raise ConfigError(
                f"cannot write --manifest {manifest!r} ({exc.strerror}); the weights are cached: run the same "
                "command with a writable --manifest path (nothing is downloaded again)"
            ) from None
    return records


def _check_writable(manifest: str) -> None:
    """A ``--manifest`` path that cannot be written: one line before any download."""
    p = Path(manifest)
    folder = p.parent if str(p.parent) else Path(".")
    why = (
        "it is a folder"
        if p.is_dir()
        else "its folder does not exist"
        if not folder.is_dir()
        else "it is not writable"
        if (p.exists() and not os.access(p, os.W_OK)) or not os.access(folder, os.W_OK)
        else ""
    )
    if why:
        raise ConfigError(f"cannot write --manifest {manifest!r} ({why}); give a writable file path")


def verify(manifest: str) -> list[dict[str, Any]]:
    """Rebuild every manifest entry offline (caches only) and compare the sha256 of its weight
    files with the manifest's; a difference raises :class:`ProvenanceMismatchError`."""
    from featcache.models.backbones import create_backbone

    try:
        records = json.loads(Path(manifest).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"cannot read manifest {manifest!r} ({exc}); write one with featcache fetch-weights"
        ) from None
    _check_records(records, manifest)
    out = []
    for rec in records:
        bb = create_backbone(rec["model"], rec["weights"], device="cpu", offline=True)
        got = _record(bb, rec["model"], rec["weights"])
        diff = [k for k in ("weights_sha256", "revision", "weight_files") if rec.get(k) != got[k]]
        if diff:
            raise ProvenanceMismatchError(
                f"{rec['model']} ({rec['weights']}): cached {', '.join(diff)} differ from {manifest} "
                f"({', '.join(f'{k}: {rec.get(k)!r} -> {got[k]!r}' for k in diff)}); re-fetch it"
            )
        out.append(got)
    return out


def _check_records(records: Any, manifest: str) -> None:
    """A manifest is a JSON list of objects, each with a ``model`` and ``weights`` string."""
    if not isinstance(records, list):
        raise ConfigError(
            f"manifest {manifest!r} is a JSON {type(records).__name__}, not the list `featcache fetch-weights "
            "--manifest` writes; write it again with that command"
        )
    for i, rec in enumerate(records):
        bad = [k for k in ("model", "weights") if not isinstance(rec, dict) or not isinstance(rec.get(k), str)]
        if bad:
            raise ConfigError(
                f"manifest {manifest!r} entry {i} has no {' or '.join(bad)} ({str(rec)[:80]}); each entry needs "
                "'model' and 'weights' as `featcache fetch-weights --manifest` writes them; write it again"
            )


def as_rows(entries: Sequence[ModelEntry]) -> list[dict[str, Any]]:
    return [asdict(e) for e in entries]


def check_items(models: Sequence[str] | None, weights: Sequence[str] | None, listing: str | None) -> list:
    """``(model, weights)`` pairs from ``--model``/``--weights`` (paired in order) and ``--list``."""
    models, weights = list(models or []), list(weights or [])
    if len(weights) > len(models):
        raise ConfigError("more --weights than --model; give one --weights per --model (or none)")
    items = [(m, weights[i] if i < len(weights) else default_weights(m)) for i, m in enumerate(models)]
    if listing:
        items += read_list(listing)
    if not items:
        raise BackboneError("name models to fetch: --model M [--weights W] (repeatable) or --list FILE")
    return items
