"""Full-ranking retrieval (mAP over the whole gallery) by blockwise exact scoring.

Queries are processed in blocks of B rows so that only a [B, G] score block exists at a time
(numpy: one buffer reused for every block; each row is sorted in a one-row buffer); B follows
from ``max_memory``. The N x N matrix never exists.

Under the tie policy of :mod:`featcache.retrieval.metrics` a relevant item p needs only
counts, no argsort of the row: with the row sorted (a fast SIMD sort of float32 values) and
the relevant scores sorted,

    r_p  = #{i : s_i >= s_p} - #{excluded i : s_i >= s_p}
    tp_p = #{relevant i : s_i >= s_p}

each a binary search (the query itself and junk items are the excluded ones).

``ties="index"`` ranks as Battle of the Backbones' code does instead (bob-retrieval
``retrieval/main_ret.py``: ``torch.argsort(-sim, dim=0)``, read as a stable sort): exactly
tied items in gallery order, so every item has its own position (:func:`row_ranks_index`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from featcache.errors import ConfigError, InternalError
from featcache.retrieval.metrics import RankedRelevance
from featcache.retrieval.prepared import PreparedRows, as_prepared

if TYPE_CHECKING:
    from featcache.retrieval.relevance import Relevance
from featcache.retrieval.search import (
    DEFAULT_MAX_MEMORY,
    exact_matmul,
    rows_per_block,
    score_block,
)

log = logging.getLogger(__name__)

__all__ = ["TIE_RULES", "full_ranking", "full_ranking_metrics", "row_ranks", "row_ranks_index"]

#: ``block``: featcache's tie policy (:mod:`featcache.retrieval.metrics`); ``index``: a
#: stable argsort of the negated scores (ties in gallery order, as Battle of the Backbones)
TIE_RULES = ("block", "index")


def row_ranks(s: np.ndarray, s_sorted: np.ndarray, pos: np.ndarray, excl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ranks, tp)`` of the items ``pos`` in one query's ranking (ranks ascending), items
    ``excl`` removed; ``s_sorted`` is ``np.sort(s)``."""
    R = pos.size
    if R == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pv = s[pos]
    pv.sort()
    n_ge = s_sorted.size - np.searchsorted(s_sorted, pv, "left")
    if excl.size:
        ev = np.sort(s[excl])
        n_ge -= ev.size - np.searchsorted(ev, pv, "left")
    new_group = np.empty(R, bool)
    new_group[0] = True
    np.not_equal(pv[1:], pv[:-1], out=new_group[1:])
    if new_group.all():  # no ties among the relevant items
        tp = np.arange(1, R + 1, dtype=np.int64)
    else:  # tp = R - (index of the first item of its tie group), in ascending order
        starts = np.flatnonzero(new_group)
        first = np.repeat(starts, np.diff(np.append(starts, R)))
        tp = (R - first)[::-1].astype(np.int64)
    return n_ge[::-1].astype(np.int64), tp


def row_ranks_index(s: np.ndarray, pos: np.ndarray, excl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(ranks, tp)`` of the items ``pos`` in the order ``np.argsort(-s, kind="stable")``
    (exact ties in gallery order), items ``excl`` removed: every item has its own position,
    so ``tp`` is 1..R."""
    R = pos.size
    if R == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(-s, kind="stable")
    place = np.empty(s.size, np.int64)
    place[order] = np.arange(s.size)
    r = np.sort(place[pos])
    if excl.size:
        r -= np.searchsorted(np.sort(place[excl]), r, "left")
    return r + 1, np.arange(1, R + 1, dtype=np.int64)


def _rank_rows(
    S: np.ndarray, lo: int, hi: int, relevance, start: int, ties: str = "block"
) -> list[tuple[np.ndarray, np.ndarray]]:
    """:func:`row_ranks` of rows ``lo:hi`` of a score block. Each row is sorted in a reused
    one-row buffer that stays in the core's cache for the binary searches that follow (numpy
    releases the GIL in sort and searchsorted, so threads run this in parallel).
    ``ties="index"``: :func:`row_ranks_index` instead."""
    if ties == "index":
        return [
            row_ranks_index(S[j], relevance.positives(start + j), relevance.excluded(start + j)) for j in range(lo, hi)
        ]
    buf = np.empty(S.shape[1], S.dtype)
    out = []
    for j in range(lo, hi):
        np.copyto(buf, S[j])
        buf.sort()
        out.append(row_ranks(S[j], buf, relevance.positives(start + j), relevance.excluded(start + j)))
    return out


def _block_masks(relevance, start: int, stop: int, n_g: int) -> tuple[np.ndarray, np.ndarray]:
    pos = np.zeros((stop - start, n_g), bool)
    excl = np.zeros((stop - start, n_g), bool)
    for j, i in enumerate(range(start, stop)):
        pos[j, relevance.positives(i)] = True
        excl[j, relevance.excluded(i)] = True
    return pos, excl


def _block_ranks_torch(St, relevance, start: int, stop: int):
    """Batched :func:`row_ranks` of a score block on a torch device (GPU): the same counts by
    ``torch.searchsorted`` over whole rows; only the ranks travel back to the host."""
    import torch

    dev = St.device
    pos_np, excl_np = _block_masks(relevance, start, stop, St.shape[1])
    pos = torch.from_numpy(pos_np).to(dev)
    excl = torch.from_numpy(excl_np).to(dev)
    neg_inf = torch.tensor(float("-inf"), dtype=St.dtype, device=dev)
    S_ex = torch.where(excl, neg_inf, St)  # excluded items never count as ranked above
    S_sorted = torch.sort(S_ex, dim=1).values
    P = torch.where(pos, S_ex, neg_inf)
    pv_asc = torch.sort(P, dim=1).values
    pv_desc = torch.flip(pv_asc, dims=[1])
    n = St.shape[1]
    n_ge = n - torch.searchsorted(S_sorted, pv_desc, side="left")
    tp = n - torch.searchsorted(pv_asc, pv_desc, side="left")
    R = pos.sum(1)
    valid = torch.arange(n, device=dev)[None, :] < R[:, None]
    counts = R.cpu().numpy()
    r_flat = n_ge[valid].cpu().numpy().astype(np.int64)
    tp_flat = tp[valid].cpu().numpy().astype(np.int64)
    splits = np.cumsum(counts)[:-1]
    return np.split(r_flat, splits), np.split(tp_flat, splits)


NUMPY_MAX_BLOCK_ROWS = 2048  # the GEMM runs at full speed from ~512 rows on; more only costs memory


def _block_rows(n_q: int, n_g: int, max_memory: int, dev) -> int:
    if dev is None:  # scores (4 B/cell) + per-thread row buffers and temporaries (~64 B x G)
        rows = rows_per_block(n_g, max(1, max_memory - 64 * n_g), 4)
        return max(1, min(n_q, rows, NUMPY_MAX_BLOCK_ROWS))
    return max(1, min(n_q, rows_per_block(n_g, max_memory, 44)))


def _torch_device(backend: str):
    if backend in ("torch-cuda", "faiss-gpu"):
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda")
    if backend == "torch-cpu":
        import torch

        return torch.device("cpu")
    return None


def full_ranking(
    Q: np.ndarray | PreparedRows,
    G: np.ndarray | PreparedRows,
    relevance: Relevance,
    metric: str,
    *,
    max_memory: int = DEFAULT_MAX_MEMORY,
    backend: str = "numpy",
    progress: bool = True,
    ties: str = "block",
) -> RankedRelevance:
    """Ranks of every relevant item of every query over the whole gallery.

    ``Q``, ``G``: features already prepared (:func:`featcache.retrieval.search.prepare`),
    or :class:`~featcache.retrieval.prepared.PreparedRows` (a streamed gallery is scored
    block by block; on a GPU its blocks fill one device tensor).
    ``backend``: ``torch-cuda``/``faiss-gpu`` score, sort and count each block on the GPU
    (torch; ``torch-cpu`` runs that code on the CPU), anything else on the CPU with numpy.
    Memory: about 4 (numpy: one reused float32 score block of at most 2048 rows, plus a few
    G-sized row buffers per thread) or 44 (torch) bytes x G per query row of a block;
    ``max_memory`` bounds the block.
    ``ties``: one of :data:`TIE_RULES` (``index``: Battle of the Backbones' order; on a torch
    device the scores are computed there and ranked on the host).
    """
    if ties not in TIE_RULES:
        raise ConfigError(f"ties must be one of {', '.join(TIE_RULES)}; got {ties!r}")
    n_q, n_g = Q.shape[0], G.shape[0]
    dev = _torch_device(backend)
    # numpy: scores + sorted copy + temporaries; torch: ~6 float and 2 int64 [B, G] arrays
    B = _block_rows(n_q, n_g, max_memory, dev)
    if dev is not None:
        with exact_matmul():
            return _full_ranking(Q, G, relevance, metric, B, dev, progress, ties=ties)[0]
    return _full_ranking(Q, G, relevance, metric, B, None, progress, ties=ties)[0]


def full_ranking_metrics(
    Q: np.ndarray | PreparedRows,
    G: np.ndarray | PreparedRows,
    relevance: Relevance,
    metric: str,
    ks: Sequence[int],
    *,
    max_memory: int = DEFAULT_MAX_MEMORY,
    backend: str = "numpy",
    progress: bool = True,
) -> dict[str, np.ndarray]:
    """Per-query metrics of the full ranking (``map``, ``mrr`` and every @k metric), equal to
    ``compute_metrics(full_ranking(...), ks)`` but keeping only ranks <= max(ks): memory
    O(Q x max(ks)) instead of one entry per (query, relevant item)."""
    from featcache.retrieval.metrics import compute_metrics

    ks = sorted({int(k) for k in ks})
    n_q, n_g = Q.shape[0], G.shape[0]
    dev = _torch_device(backend)
    B = _block_rows(n_q, n_g, max_memory, dev)
    if dev is not None:
        with exact_matmul():
            rr, ap, rec = _full_ranking(Q, G, relevance, metric, B, dev, progress, keep=ks[-1])
    else:
        rr, ap, rec = _full_ranking(Q, G, relevance, metric, B, None, progress, keep=ks[-1])
    out = {"map": ap, "mrr": rec}
    out.update(compute_metrics(rr, ks, full=False))
    return out


def _full_ranking(Q, G, relevance, metric, B, dev, progress, keep: int | None = None, ties: str = "block"):
    Q, G = as_prepared(Q, metric), as_prepared(G, metric)
    n_q, n_g = Q.shape[0], G.shape[0]
    if dev is not None:
        import torch

        Gt = G.to_torch(dev)
        g_sq_t = (Gt * Gt).sum(1) if metric == "l2" else None
    g_sq = G.sq_norms() if metric == "l2" and dev is None else None
    log.info(
        "full ranking: %d queries x %d gallery, blocks of %d rows (%s)",
        n_q,
        n_g,
        B,
        "torch " + str(dev) if dev is not None else "numpy",
    )
    n_relevant = relevance.n_relevant()
    all_ranks: list[np.ndarray] = []
    all_tp: list[np.ndarray] = []
    ap = np.full(n_q, np.nan)
    rec = np.full(n_q, np.nan)

    def add(i: int, r: np.ndarray, tp: np.ndarray) -> None:
        if keep is not None:
            if r.size:
                ap[i] = float(np.sum(tp / r)) / r.size
                rec[i] = 1.0 / r[0]
            cut = np.searchsorted(r, keep, "right")
            r, tp = r[:cut], tp[:cut]
        all_ranks.append(r)
        all_tp.append(tp)

    try:
        from featcache.core.progress import tqdm
    except ImportError:  # pragma: no cover

        def tqdm(x, **_):
            return x

    import os
    from concurrent.futures import ThreadPoolExecutor

    n_threads = max(1, min(8, os.cpu_count() or 1)) if dev is None else 1
    buf = np.empty((B, n_g), np.float32) if dev is None else None  # one score block, reused
    with ThreadPoolExecutor(n_threads) as pool:
        for start in tqdm(range(0, n_q, B), desc="full ranking", unit="block", disable=not progress):
            stop = min(n_q, start + B)
            if dev is not None:
                Qb = torch.from_numpy(Q.block(start, stop)).to(dev)
                St = Qb @ Gt.T
                if metric == "l2":
                    assert g_sq_t is not None  # computed above for l2
                    St = 2 * St - (Qb * Qb).sum(1)[:, None] - g_sq_t[None, :]
                if ties == "index":  # BoB's order: rank the device's scores on the host
                    rows = _rank_rows(St.cpu().numpy(), 0, stop - start, relevance, start, ties)
                    r, tp = [a for a, _ in rows], [t for _, t in rows]
                else:
                    r, tp = _block_ranks_torch(St, relevance, start, stop)
                for j, (rj, tj) in enumerate(zip(r, tp)):
                    add(start + j, rj, tj)
                del St
                continue
            b = stop - start
            assert buf is not None  # allocated for the numpy path
            S = score_block(Q.block(start, stop), G, metric, g_sq, out=buf[:b])
            bounds = np.linspace(0, b, n_threads + 1).astype(int)
            parts = [(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds) if hi > lo]
            futures = [pool.submit(_rank_rows, S, lo, hi, relevance, start, ties) for lo, hi in parts]
            results = [f.result() for f in futures]
            i = start
            for res in results:
                for r, tp in res:
                    add(i, r, tp)
                    i += 1
    counts = np.array([r.size for r in all_ranks], np.int64)
    if keep is None and np.any(counts != n_relevant):
        raise InternalError("internal error: ranked relevant items != number of relevant items")
    indptr = np.zeros(n_q + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    ranks = np.concatenate(all_ranks) if all_ranks else np.zeros(0, np.int64)
    tp = np.concatenate(all_tp) if all_tp else np.zeros(0, np.int64)
    return RankedRelevance(indptr, ranks, n_relevant, depth=keep, tp=tp), ap, rec
