"""Representational similarity between backbones, and a train/test near-duplicate audit,
from the cached features.

- :func:`run_similarity`: linear, debiased and RBF CKA and RSA for every backbone pair on
  one split, rows joined by sample id, written as results rows (``kind="similarity"``).
- ``SimilarityConfig(layers="all")``: layer-by-layer linear, debiased (and minibatch) CKA
  between every stored layer kind of each backbone and every layer of the others and of
  itself (:mod:`featcache.similarity.layers`, :mod:`featcache.similarity.layer_runner`).
- :func:`run_audit`: each test (and val) row's nearest training rows by cosine, the pairs
  above a threshold, exact duplicates by content hash, and kNN top-1 with those rows left out.
- :mod:`featcache.similarity.measures` the measures as pure numpy functions;
  :mod:`featcache.similarity.streaming` their streamed / minibatch forms for any N;
  :mod:`featcache.similarity.registry` the ``MEASURES`` the stage computes, one
  :func:`register_measure` each (a measure of your own: the same call in your module).

>>> from featcache.similarity import SimilarityConfig, run_similarity
>>> cfg = SimilarityConfig(cache="cache.zarr", dataset="digits", results_path="r.parquet")
>>> df = run_similarity(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

from featcache.similarity.align import AlignmentError, align_ids
from featcache.similarity.audit import AuditReport, run_audit
from featcache.similarity.config import AuditConfig, SimilarityConfig
from featcache.similarity.measures import (
    RDM_METHODS,
    center_gram,
    cka,
    gram_linear,
    gram_rbf,
    linear_cka,
    rbf_cka,
    rdm,
    rsa,
)
from featcache.similarity.registry import MEASURES, Measure, register_measure
from featcache.similarity.runner import compare, run_similarity
from featcache.similarity.streaming import LinearCKAStream, MinibatchCKA

__all__ = [
    "MEASURES",
    "RDM_METHODS",
    "AlignmentError",
    "AuditConfig",
    "AuditReport",
    "LinearCKAStream",
    "Measure",
    "MinibatchCKA",
    "SimilarityConfig",
    "align_ids",
    "center_gram",
    "cka",
    "compare",
    "gram_linear",
    "gram_rbf",
    "linear_cka",
    "rbf_cka",
    "rdm",
    "register_measure",
    "rsa",
    "run_audit",
    "run_similarity",
]
