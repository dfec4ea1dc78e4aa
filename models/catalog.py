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

from featcache.errors import BackboneError, ConfigError, ProvenanceMismatchError

logger = logging.getLogger(__name__)

__all__ = ["ModelEntry", "fetch", "list_models", "read_list", "verify"]

SOURCES = ("timm", "open_clip", "torchvision", "hf")


@dataclass(frozen=True)
class ModelEntry:
    """One name a user can type: ``--model model --weights weights``; ``cached``: its weights
    are in the local cache (None: not known without reading the network)."""

    source: str
    model: str
    weights: str
    cached: bool | None


def list_models(pattern: str = "*", sources: Sequence[str] = SOURCES) -> Iterator[ModelEntry]:
    """Every name matching ``pattern`` (fnmatch, case-insensitive) of the installed sources."""
    pat = pattern.lower()
    for s in sources:
        if s not in SOURCES:
            raise ConfigError(f"--source {s!r}: choose from {', '.join(SOURCES)}")
        try:
            rows = list(_LISTERS[s]())
        except ImportError:
            logger.info("model source %s is not installed; skipped", s)
            continue
        for model, weights, cached in rows:
            if fnmatch.fnmatch(f"{model} {weights}".lower(), f"*{pat}*" if "*" not in pat else pat) or fnmatch.fnmatch(
                model.lower(), pat
            ):
                yield ModelEntry(s, model, weights, cached)


def _timm() -> Iterator[tuple[str, str, bool | None]]:
    import timm

    from featcache.models.weights import find_timm_cached_checkpoint

    for name in timm.list_pretrained():
        cfg = timm.models.get_pretrained_cfg(name)
        yield name, "pretrained", find_timm_cached_checkpoint(cfg.to_dict()) is not None if cfg else None


def _open_clip() -> Iterator[tuple[str, str, bool | None]]:
    import open_clip

    from featcache.models.sources.open_clip_source import cached_file

    for arch, tag in open_clip.list_pretrained():
        yield f"open_clip:{arch}", tag, cached_file(open_clip.get_pretrained_cfg(arch, tag)) is not None


def _torchvision() -> Iterator[tuple[str, str, bool | None]]:
    import torch
    import torchvision

    ckpt = Path(torch.hub.get_dir()) / "checkpoints"
    for name in torchvision.models.list_models():
        try:
            enum = torchvision.models.get_model_weights(name)
        except ValueError:
            continue
        for m in enum:
            yield f"torchvision:{name}", m.name, (ckpt / os.path.basename(m.url)).is_file()


def _hf() -> Iterator[tuple[str, str, bool | None]]:
    """The model repos in the Hugging Face hub cache (the hub itself is not listed offline)."""
    from featcache.models.sources.hub import hf_cache_dir

    root = hf_cache_dir()
    for d in sorted(root.glob("models--*--*")) if root.is_dir() else []:
        repo = d.name[len("models--") :].replace("--", "/", 1)
        if (d / "snapshots").is_dir() and any((d / "snapshots").iterdir()):
            yield f"hf:{repo}", "dir", True


_LISTERS = {"timm": _timm, "open_clip": _open_clip, "torchvision": _torchvision, "hf": _hf}


# --------------------------------------------------------------------------- fetch / verify
def read_list(path: str) -> list[tuple[str, str]]:
    """``MODEL [WEIGHTS]`` per line (``#`` comments); WEIGHTS defaults to the source's own."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        parts = line.split("#", 1)[0].split()
        if not parts:
            continue
        if len(parts) > 2:
            raise ConfigError(f"{path}:{n}: expected 'MODEL [WEIGHTS]', got {line.strip()!r}")
        out.append((parts[0], parts[1] if len(parts) == 2 else default_weights(parts[0])))
    return out


def default_weights(model: str) -> str:
    """The weights a bare model name fetches: timm's ``pretrained``, hf's own, torchvision's DEFAULT."""
    if model.startswith("hf:"):
        return "dir"
    if model.startswith("torchvision:"):
        return "DEFAULT"
    if model.startswith("open_clip:") and not model.startswith("open_clip:hf-hub:"):
        raise ConfigError(f"{model}: name its pretrained tag (see `featcache models --source open_clip`)")
    return "pretrained" if not model.startswith("open_clip:") else "timm"


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


def fetch(items: Sequence[tuple[str, str]], manifest: str | None = None) -> list[dict[str, Any]]:
    """Build each ``(model, weights)`` once through its library's client (downloading what is
    not cached); write the manifest (JSON list) if given."""
    from featcache.models.backbones import create_backbone

    records = []
    for model, weights in items:
        bb = create_backbone(model, weights, device="cpu")
        records.append(_record(bb, model, weights))
        logger.info("fetched %s (%s): sha256 %s", model, weights, bb.weights_sha256[:12])
    if manifest:
        Path(manifest).write_text(json.dumps(records, indent=1) + "\n")
    return records


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
