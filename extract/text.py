"""Class embeddings from a backbone's text tower (``featcache embed-classes``).

Class names x prompt templates go through the tower (open_clip's ``encode_text``, HF
``CLIPModel.get_text_features``); as open_clip's ``build_zero_shot_classifier`` (and
ELEVATER's zero-shot head) does, each prompt's embedding is L2-normalised, the prompts of a
class are averaged and the mean renormalised. The ``[C, D]`` matrix is stored as the class
embeddings of that backbone x dataset (``FeatureCache.load_class_embeddings(dataset,
backbone=B)``), with its provenance (tower, templates and their hash) in the array's attributes;
re-embedding with another tower or template set is refused with the difference unless
``overwrite``.

Templates: ``clip-imagenet`` (CLIP's 80 ImageNet prompts, ``open_clip.OPENAI_IMAGENET_TEMPLATES``),
``simple`` (``open_clip.SIMPLE_IMAGENET_TEMPLATES``), or a file: one template per line with
``{}`` or ``{c}`` for the class name, or a JSON list, or CLIP_benchmark's
``zeroshot_classification_templates.json`` (dataset -> list; the dataset's entry is used).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from featcache.errors import BackboneError, ConfigError, SchemaMismatchError

logger = logging.getLogger(__name__)

TEMPLATE_SETS = ("clip-imagenet", "simple")
CLASSES_PER_BATCH = 10  # as open_clip's build_zero_shot_classifier


def load_templates(spec: str, dataset: str = "") -> list[str]:
    """Template strings (``{}`` = the class name) of a named set or a file."""
    if spec in TEMPLATE_SETS:
        from featcache.extract.sources import require

        oc = require("open_clip", "open_clip")
        fns = oc.OPENAI_IMAGENET_TEMPLATES if spec == "clip-imagenet" else oc.SIMPLE_IMAGENET_TEMPLATES
        return [t("{}") if callable(t) else str(t) for t in fns]
    p = Path(spec).expanduser()
    if not p.is_file():
        raise ConfigError(f"--templates {spec!r}: give {' | '.join(TEMPLATE_SETS)} or a templates file")
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        obj = json.loads(text)
        if isinstance(obj, dict):
            if dataset not in obj:
                raise ConfigError(f"--templates {spec}: no entry for dataset {dataset!r} (has {sorted(obj)[:8]})")
            obj = obj[dataset]
        out = [str(t) for t in obj]
    else:
        out = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    out = [t.replace("{c}", "{}") for t in out]
    if not out or any("{}" not in t for t in out):
        raise ConfigError(f"--templates {spec}: every template needs {{}} (or {{c}}) where the class name goes")
    return out


def templates_sha256(templates: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(templates).encode()).hexdigest()


def embed_classes(encode: Callable[[list[str]], Any], class_names: Sequence[str], templates: Sequence[str]):
    """``[C, D]`` float32: per class, normalise each prompt's embedding, average, renormalise."""
    import torch
    import torch.nn.functional as F

    rows = []
    for i in range(0, len(class_names), CLASSES_PER_BATCH):
        batch = list(class_names[i : i + CLASSES_PER_BATCH])
        texts = [t.format(c) for c in batch for t in templates]
        with torch.no_grad():
            e = F.normalize(encode(texts), dim=-1).reshape(len(batch), len(templates), -1).mean(dim=1)
            rows.append(e / e.norm(dim=1, keepdim=True))
    return torch.cat(rows).float().cpu().numpy()


def write_embeddings(cache: Any, dataset: str, backbone: str, m: np.ndarray, prov: dict, name: str, overwrite: bool):
    """Store ``m`` with ``prov``; refuse other provenance already stored (unless ``overwrite``)."""
    from featcache.store import write_class_embeddings

    g = cache._group("class_embeddings", dataset, backbone)
    if g is not None and name in {k for k, _ in g.arrays()} and not overwrite:
        old = dict(g[name].attrs.get("featcache_text", {}))
        diff = {k: (old.get(k), v) for k, v in prov.items() if old.get(k) != v}
        if diff:
            raise SchemaMismatchError(
                f"class embeddings {name!r} of {backbone}/{dataset} came from other settings {diff}; "
                "pass --overwrite (Python: overwrite=True) to replace them"
            )
    write_class_embeddings(cache, dataset, m, name, backbone=backbone)
    cache.root[f"class_embeddings/{dataset}/{backbone}/{name}"].attrs["featcache_text"] = prov


def run(
    cache_path: str,
    model: Any,
    weights: str,
    dataset: str,
    templates: str,
    *,
    backbone: str | None = None,
    name: str = "text",
    overwrite: bool = False,
    device: str = "cpu",
) -> tuple[str, np.ndarray]:
    """Embed ``dataset``'s class names (from the store) with ``model``'s text tower ->
    ``(backbone key, matrix)``."""
    from featcache.extract.backbones import create_backbone
    from featcache.store import open_cache

    bb = create_backbone(model, weights, device=device)
    if bb.text_tower is None:
        raise BackboneError(f"{bb.name} has no text tower; use an open_clip:ARCH or hf:DIR CLIPModel backbone")
    cache = open_cache(cache_path, "a")
    if dataset not in cache.datasets():
        raise ConfigError(f"--dataset {dataset!r} is not in {cache_path} (has {cache.datasets()}); extract it first")
    classes = list(cache.split_meta(dataset, cache.splits(dataset)[0]).class_names)
    tmpl = load_templates(templates, dataset)
    m = embed_classes(bb.text_tower.encode, classes, tmpl)
    key = backbone or bb.default_key
    prov = {
        "tower": bb.text_tower.name,
        "weights_sha256": bb.weights_sha256,
        "templates": templates if templates in TEMPLATE_SETS else Path(templates).name,
        "templates_sha256": templates_sha256(tmpl),
        "n_templates": len(tmpl),
        "library_version": bb.data_config.get("library_version", ""),
    }
    write_embeddings(cache, dataset, key, m, prov, name, overwrite)
    logger.info("class embeddings %s/%s/%s: %d classes x %d templates", dataset, key, name, len(classes), len(tmpl))
    return key, m
