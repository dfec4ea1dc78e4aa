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
from featcache.errors import BackboneError, ConfigError, ProvenanceMismatchError, SchemaMismatchError

__all__ = ["TEMPLATE_SETS", "embed_classes", "load_templates", "run", "templates_sha256", "write_embeddings"]

logger = logging.getLogger(__name__)

#: prompts per text-tower forward: the activations of one forward, not of a class batch
#: (open_clip's build_zero_shot_classifier runs 10 classes x all templates, 800 prompts with
#: CLIP's 80), stay near the tower's own size
PROMPTS_PER_BATCH = 64


def embed_classes(
    encode: Callable[[list[str]], Any],
    class_names: Sequence[str],
    templates: Sequence[str],
    batch_size: int = PROMPTS_PER_BATCH,
) -> np.ndarray:
    """``[C, D]`` float32: per class, normalise each prompt's embedding, average, renormalise
    (open_clip's ``build_zero_shot_classifier``), the prompts encoded ``batch_size`` at a time
    whatever the number of templates."""
    import torch
    import torch.nn.functional as F

    n_t, total = len(templates), len(class_names) * len(templates)
    sums: Any = None
    for i in range(0, total, batch_size):
        rows = range(i, min(i + batch_size, total))  # prompt j: template j % T of class j // T
        texts = [templates[j % n_t].format(class_names[j // n_t]) for j in rows]
        with torch.no_grad():
            e = F.normalize(encode(texts).float(), dim=-1).cpu()
        if sums is None:
            sums = torch.zeros(len(class_names), e.shape[1], dtype=torch.float32)
        sums.index_add_(0, torch.as_tensor([j // n_t for j in rows]), e)
    mean = sums / n_t
    return (mean / mean.norm(dim=1, keepdim=True)).float().numpy()


def write_embeddings(
    cache: Any, dataset: str, backbone: str, m: np.ndarray, prov: dict, name: str, overwrite: bool
) -> None:
    """Store ``m`` with ``prov``; refuse other provenance already stored (unless ``overwrite``)."""
    from featcache.store import write_class_embeddings

    if cache.has_class_embeddings(dataset, name, backbone) and not overwrite:
        old = cache.class_embeddings_provenance(dataset, name, backbone)
        diff = {k: (old.get(k), v) for k, v in prov.items() if old.get(k) != v and (k in old or not old)}
        if diff:
            raise SchemaMismatchError(
                f"class embeddings {name!r} of {backbone}/{dataset} came from other settings {diff}; "
                "pass --overwrite (Python: overwrite=True) to replace them"
            )
    write_class_embeddings(cache, dataset, m, name, backbone=backbone, provenance=prov)


def recorded_model(cache: Any, dataset: str, backbone: str | None) -> tuple[str, str, str]:
    """``(model, weights, weights sha256)`` of backbone ``backbone``'s stored features of
    ``dataset`` (its recorded provenance): the text tower follows the image tower."""
    if backbone is None:
        raise ConfigError("give --backbone B (its recorded model and weights are used) or --model and --weights")
    entries = [(s, k) for b, d, s in cache.entries() if b == backbone and d == dataset for k in cache.kinds(b, d, s)]
    if not entries:
        have = sorted({b for b, d, _ in cache.entries() if d == dataset})
        raise ConfigError(
            f"--backbone {backbone!r} has no features of {dataset!r} in the store (has {have}); "
            "extract it first, or give --model and --weights"
        )
    split, kind = entries[0]
    prov = cache.provenance(backbone, dataset, split, kind)
    if prov.model_name.startswith("module:") or (prov.data_config or {}).get("source") == "module":
        raise ConfigError(
            f"backbone {backbone!r} was an nn.Module passed in Python; its model cannot be rebuilt by name: "
            "give --model and --weights"
        )
    return prov.model_name, prov.weights_source, prov.weights_sha256


def text_tower_backbone(
    cache: Any, dataset: str, backbone: str | None, model: Any, weights: str | None, device: str
) -> Any:
    """The backbone whose text tower embeds for ``backbone``'s features of ``dataset``: ``model``
    (with ``weights``), or with ``model=None`` the recorded one (:func:`recorded_model`), then
    held to the recorded weights' sha256. Refused: weights that changed since (a
    :class:`ProvenanceMismatchError`), a backbone without a text tower (a BackboneError)."""
    from featcache.models.backbones import create_backbone

    want_sha = None
    if model is None:
        model, weights, want_sha = recorded_model(cache, dataset, backbone)
    bb = create_backbone(model, weights or "timm", device=device)
    if want_sha is not None and bb.weights_sha256 != want_sha:
        raise ProvenanceMismatchError(
            f"backbone {backbone!r} was extracted with weights sha256 {want_sha[:12]}... but {model} "
            f"({weights}) now has {bb.weights_sha256[:12]}...; give --model and --weights of the same weights"
        )
    if bb.text_tower is None:
        raise BackboneError(f"{bb.name} has no text tower; use an open_clip:ARCH or hf:DIR CLIPModel backbone")
    return bb


def run(
    cache_path: str,
    model: Any,
    weights: str | None,
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
    ``model=None``: the model and weights recorded for ``backbone``'s features of ``dataset``
    (:func:`recorded_model`), checked by the weights' sha256.

    ``classnames``: ``store`` (the store's), ``elevater``, ``clip-benchmark`` or a file; default
    ELEVATER's own with ``templates="elevater"``, CLIP_benchmark's where it names the dataset
    with ``templates="clip-benchmark"``, else the store's. ``prompt_dataset``: the dataset's
    name in those sets (default ``dataset``, matched as :func:`featcache.core.prompts.resolve_dataset`)."""
    from featcache.store import open_cache

    cache = open_cache(cache_path, "a")
    if dataset not in cache.datasets():
        raise ConfigError(f"--dataset {dataset!r} is not in {cache_path} (has {cache.datasets()}); extract it first")
    stored = _stored_class_names(cache, dataset)
    pd = prompt_dataset or dataset
    classes = _class_names(classnames, templates, pd, stored)  # bad names/templates fail before the model
    tmpl = load_templates(templates, pd)
    bb = text_tower_backbone(cache, dataset, backbone, model, weights, device)
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
    from featcache.store import load_label_matrix

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
