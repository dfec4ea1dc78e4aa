"""Class embeddings from a backbone's text tower (``featcache embed-classes``).

Class names x prompt templates go through the tower (open_clip's ``encode_text``, HF
``CLIPModel.get_text_features``); as open_clip's ``build_zero_shot_classifier`` (and
ELEVATER's zero-shot head) does, each prompt's embedding is L2-normalised, the prompts of a
class are averaged and the mean renormalised. The ``[C, D]`` matrix is stored as the class
embeddings of that backbone x dataset (``FeatureCache.load_class_embeddings(dataset,
backbone=B)``), with its provenance (tower, templates and their hash) in the array's attributes;
re-embedding with another tower or template set is refused with the difference unless
``overwrite``.

Templates and class names: :mod:`featcache.core.prompts` (CLIP's, ELEVATER's and CLIP_benchmark's
sets, or files in CLIP_benchmark's ``classnames.txt`` / ``zeroshot_classification_templates.txt``
layout).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from featcache.core.prompts import (
    TEMPLATE_SETS,
    load_classnames,
    load_templates,
    template_label,
    templates_sha256,
)
from featcache.errors import BackboneError, ConfigError, SchemaMismatchError

__all__ = ["TEMPLATE_SETS", "embed_classes", "load_templates", "run", "templates_sha256", "write_embeddings"]

logger = logging.getLogger(__name__)

CLASSES_PER_BATCH = 10  # as open_clip's build_zero_shot_classifier


def embed_classes(
    encode: Callable[[list[str]], Any], class_names: Sequence[str], templates: Sequence[str]
) -> np.ndarray:
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


def write_embeddings(
    cache: Any, dataset: str, backbone: str, m: np.ndarray, prov: dict, name: str, overwrite: bool
) -> None:
    """Store ``m`` with ``prov``; refuse other provenance already stored (unless ``overwrite``)."""
    from featcache.store import write_class_embeddings
    from featcache.store.schema import TEXT_PROVENANCE_KEY

    g = cache._group("class_embeddings", dataset, backbone)
    if g is not None and name in {k for k, _ in g.arrays()} and not overwrite:
        old = cache.class_embeddings_provenance(dataset, name, backbone)
        diff = {k: (old.get(k), v) for k, v in prov.items() if old.get(k) != v and (k in old or not old)}
        if diff:
            raise SchemaMismatchError(
                f"class embeddings {name!r} of {backbone}/{dataset} came from other settings {diff}; "
                "pass --overwrite (Python: overwrite=True) to replace them"
            )
    write_class_embeddings(cache, dataset, m, name, backbone=backbone)
    cache.root[f"class_embeddings/{dataset}/{backbone}/{name}"].attrs[TEXT_PROVENANCE_KEY] = prov


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
    classnames: str | None = None,
    prompt_dataset: str | None = None,
) -> tuple[str, np.ndarray]:
    """Embed ``dataset``'s class names with ``model``'s text tower -> ``(backbone key, matrix)``.

    ``classnames``: ``store`` (the store's), ``elevater``, ``clip-benchmark`` or a file; default
    ELEVATER's own with ``templates="elevater"``, CLIP_benchmark's where it names the dataset
    with ``templates="clip-benchmark"``, else the store's. ``prompt_dataset``: the dataset's
    name in those sets (default ``dataset``, matched as :func:`featcache.core.prompts.resolve_dataset`)."""
    from featcache.extract.backbones import create_backbone
    from featcache.store import open_cache

    cache = open_cache(cache_path, "a")
    if dataset not in cache.datasets():
        raise ConfigError(f"--dataset {dataset!r} is not in {cache_path} (has {cache.datasets()}); extract it first")
    stored = _stored_class_names(cache, dataset)
    pd = prompt_dataset or dataset
    classes = _class_names(classnames, templates, pd, stored)  # bad names/templates fail before the model
    tmpl = load_templates(templates, pd)
    bb = create_backbone(model, weights, device=device)
    if bb.text_tower is None:
        raise BackboneError(f"{bb.name} has no text tower; use an open_clip:ARCH or hf:DIR CLIPModel backbone")
    m = embed_classes(bb.text_tower.encode, classes, tmpl)
    key = backbone or bb.default_key
    prov = {
        "tower": bb.text_tower.name,
        "weights_sha256": bb.weights_sha256,
        "templates": template_label(templates),
        "templates_sha256": templates_sha256(tmpl),
        "n_templates": len(tmpl),
        "classnames_sha256": templates_sha256(classes),
        "library_version": bb.data_config.get("library_version", ""),
    }
    write_embeddings(cache, dataset, key, m, prov, name, overwrite)
    logger.info("class embeddings %s/%s/%s: %d classes x %d templates", dataset, key, name, len(classes), len(tmpl))
    return key, m


def _stored_class_names(cache, dataset: str) -> list[str]:
    """The store's classes of ``dataset``: its label-matrix columns when it has multi-label
    targets (one embedding per label, as the probes' heads need), else its class names."""
    from featcache.store.tasks import load_label_matrix

    first = cache.splits(dataset)[0]
    lm = load_label_matrix(cache, dataset, first)
    return list(lm[1]) if lm is not None else list(cache.split_meta(dataset, first).class_names)


def _class_names(spec: str | None, templates: str, dataset: str, stored: list[str]) -> list[str]:
    """The class names to embed (see :func:`run`), checked against the store's class count."""
    from featcache.core.prompts import resolve_dataset

    if spec is None:
        spec = "store"
        if templates == "elevater" or (
            templates == "clip-benchmark" and resolve_dataset("clip-benchmark", dataset, "classes")
        ):
            spec = templates
    names = stored if spec == "store" else load_classnames(spec, dataset)
    if len(names) != len(stored):
        raise ConfigError(
            f"--classnames {spec} gives {len(names)} class names for {dataset!r} but the store's dataset has "
            f"{len(stored)} classes; give the names of this dataset in its class order (--classnames FILE, "
            "one per line) or --classnames store"
        )
    return names
