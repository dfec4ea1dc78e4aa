"""Representational similarity between backbones, and a train/test near-duplicate audit,
from the cached features.

- :func:`run_similarity`: linear, debiased and RBF CKA and RSA for every backbone pair on
  one split, rows joined by sample id, written as results rows (``kind="similarity"``).
- :func:`run_audit`: each test (and val) row's nearest training rows by cosine, the pairs
  above a threshold, exact duplicates by content hash, and kNN top-1 with those rows left out.
- :mod:`featcache.similarity.measures` the measures as pure numpy functions;
  :mod:`featcache.similarity.streaming` their streamed / minibatch forms for any N.

>>> from featcache.similarity import SimilarityConfig, run_similarity
>>> cfg = SimilarityConfig(cache="cache.zarr", dataset="digits", results_path="r.parquet")
>>> df = run_similarity(cfg)  # doctest: +SKIP
"""

from __future__ import annotations

from featcache.similarity.align import AlignmentError, align_ids
from featcache.similarity.audit import AuditReport, run_audit
from featcache.similarity.config import MEASURES, AuditConfig, SimilarityConfig
from featcache.similarity.measures import center_gram, cka, gram_linear, gram_rbf, linear_cka, rbf_cka, rdm, rsa
from featcache.similarity.runner import compare, run_similarity
from featcache.similarity.streaming import LinearCKAStream, MinibatchCKA

__all__ = [
    "MEASURES",
    "AlignmentError",
    "AuditConfig",
    "AuditReport",
    "LinearCKAStream",
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
    "rsa",
    "run_audit",
    "run_similarity",
]
