"""Revisited Oxford/Paris (ROxford5k, RParis6k; Radenović et al., CVPR 2018) evaluation.

The published numbers use the ``revisitop`` toolkit's average precision, which differs from
scikit-learn's (featcache's ``map``): it is the area under the precision-recall curve with
**trapezoidal** interpolation between consecutive positives. For positive number j (0-based)
at 0-based position r of the ranking (after junk is removed)::

    p0 = 1 if r == 0 else j / r        (precision just before the positive)
    p1 = (j + 1) / (r + 1)             (precision at the positive)
    AP = sum_j (p0 + p1) / 2 / R       (R = number of positives of the query)

One positive at rank 2 (r = 1) gives (0 + 1/2) / 2 = 0.25, where sklearn-style AP gives 0.5.

Ground truth per query holds ``easy``, ``hard`` and ``junk`` images; the three setups are

=======  =====================  ========================
setup    positives              removed from the ranking
=======  =====================  ========================
easy     easy                   junk + hard
medium   easy + hard            junk
hard     hard                   junk + easy
=======  =====================  ========================

Papers report Medium and Hard. mP@k is revisitop's: with k' = min(k, rank of the last
positive), the fraction of the top k' that are positives.

featcache's tie policy applies (:mod:`featcache.retrieval.metrics`): a tie group is ranked as
a block at its last position, so the formula is evaluated with r = r_p - 1 and j = tp_p - 1.
Without ties this is exactly revisitop's value.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from featcache.errors import DataError
from featcache.retrieval.metrics import RankedRelevance, register_retrieval_metric

__all__ = [
    "REVISITED_SETUPS",
    "REVISITED_VALUES",
    "bob_mrr",
    "is_revisited_table",
    "revisited_ap",
    "revisited_precision_at_k",
    "revisited_table",
    "table_from_revisitop_gnd",
]

REVISITED_SETUPS = ("easy", "medium", "hard")
REVISITED_VALUES = ("easy", "hard", "junk")
_POSITIVE = {"easy": ("easy",), "medium": ("easy", "hard"), "hard": ("hard",)}


def is_revisited_table(relevance_values: np.ndarray) -> bool:
    """True when a relevance column uses revisitop's labels (easy/hard/junk, no 'positive')."""
    vals = set(np.unique(np.asarray(relevance_values).astype(str)).tolist())
    return bool(vals & {"easy", "hard"}) and vals <= set(REVISITED_VALUES)


def revisited_table(
    query_ids: ArrayLike, gallery_ids: ArrayLike, relevance_values: ArrayLike, setup: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An easy/hard/junk table -> the positive/junk table of one setup (easy, medium, hard)."""
    if setup not in _POSITIVE:
        raise DataError(f"unknown revisited setup {setup!r}; choose one of {REVISITED_SETUPS}")
    rel = np.asarray(relevance_values).astype(str)
    bad = sorted(set(np.unique(rel).tolist()) - set(REVISITED_VALUES))
    if bad:
        raise DataError(
            f"a revisited Oxford/Paris relevance file holds only {REVISITED_VALUES}, "
            f"found {bad[:5]}; use 'positive'/'junk' files without a revisited setup"
        )
    out = np.where(np.isin(rel, _POSITIVE[setup]), "positive", "junk")
    return np.asarray(query_ids).astype(str), np.asarray(gallery_ids).astype(str), out


def table_from_revisitop_gnd(gnd: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """revisitop's ground-truth dict (``gnd_roxford5k.pkl`` / ``gnd_rparis6k.pkl``, loaded by
    the caller) -> (query_id, gallery_id, relevance) arrays for a relevance file.

    Ids are the image names of ``qimlist``/``imlist``; use them as the sample ids of the
    extracted query and gallery splits. The query bounding boxes (``bbx``) are not used
    here: revisitop crops each query image to its box before extracting features.
    """
    try:
        qnames, gnames, entries = gnd["qimlist"], gnd["imlist"], gnd["gnd"]
    except (KeyError, TypeError) as exc:
        raise DataError(
            "expected revisitop's ground truth: a dict with 'qimlist', 'imlist' "
            "and 'gnd' (load gnd_roxford5k.pkl / gnd_rparis6k.pkl)"
        ) from exc
    if len(entries) != len(qnames):
        raise DataError(f"ground truth holds {len(entries)} entries for {len(qnames)} queries")
    q, g, r = [], [], []
    for name, entry in zip(qnames, entries):
        for label in REVISITED_VALUES:
            idx = np.asarray(entry.get(label, []), np.int64).ravel()
            if idx.size and (idx.min() < 0 or idx.max() >= len(gnames)):
                raise DataError(f"query {name!r}: {label} index outside imlist (0..{len(gnames) - 1})")
            q += [str(name)] * idx.size
            g += [str(gnames[i]) for i in idx]
            r += [label] * idx.size
    return np.asarray(q, str), np.asarray(g, str), np.asarray(r, str)


def revisited_ap(rr: RankedRelevance) -> np.ndarray:
    """Per query: revisitop's trapezoidal AP over the full ranking (NaN where R = 0)."""
    rr._need(None, "revisited map")
    r = (rr.ranks - 1).astype(np.float64)  # 0-based position of each positive
    j = (rr.tp - 1).astype(np.float64)  # positives ranked before it
    with np.errstate(invalid="ignore", divide="ignore"):
        p0 = np.where(r == 0, 1.0, j / np.where(r == 0, 1.0, r))
    p1 = (j + 1.0) / (r + 1.0)
    s = np.bincount(rr.query_index(), weights=(p0 + p1) / 2.0, minlength=rr.n_queries)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(rr.n_relevant > 0, s / rr.n_relevant, np.nan)


def revisited_precision_at_k(rr: RankedRelevance, k: int) -> np.ndarray:
    """Per query: revisitop's mP@k, |{p : r_p <= k'}| / k' with k' = min(k, max_p r_p)."""
    rr._need(None, f"revisited mp@{k}")
    q = rr.query_index()
    last = np.zeros(rr.n_queries, np.int64)
    np.maximum.at(last, q, rr.ranks)
    kq = np.minimum(last, int(k))
    within = np.bincount(q, weights=rr.ranks <= kq[q], minlength=rr.n_queries)
    with np.errstate(invalid="ignore", divide="ignore"):
        val = within / np.maximum(kq, 1)
    return np.where(rr.n_relevant > 0, val, np.nan)


def bob_mrr(rr_with_junk: RankedRelevance) -> float:
    """Battle of the Backbones' MRR (bob-retrieval ``retrieval/utils.py``, ``compute_map``):
    1 / (rank of the first positive) in the ranking **before** junk is removed, summed over
    the queries with a positive and divided by **all** queries (one without positives adds 0).

    ``rr_with_junk``: the full ranking with only the query itself removed (junk kept)."""
    rr_with_junk._need(None, "bob mrr")
    n_q = rr_with_junk.n_queries
    if n_q == 0:
        return float("nan")
    counts = np.diff(rr_with_junk.indptr)
    has = counts > 0
    first = rr_with_junk.ranks[rr_with_junk.indptr[:-1][has]]
    return float(np.sum(1.0 / first) / n_q)


# Battle of the Backbones' definitions, written by ``featcache retrieve`` beside featcache's
# (``map_revisitop`` / ``mp_revisitop@k`` are their older names, on Revisited Oxford/Paris)
register_retrieval_metric("map_bob", full=True, at_k=False, source="bob")(revisited_ap)
register_retrieval_metric("mp", full=False, at_k=True, source="bob")(revisited_precision_at_k)
register_retrieval_metric("mrr_bob", full=True, at_k=False, source="bob")(bob_mrr)
register_retrieval_metric("map_revisitop", full=True, at_k=False, source="bob")(revisited_ap)
register_retrieval_metric("mp_revisitop", full=False, at_k=True, source="bob")(revisited_precision_at_k)
