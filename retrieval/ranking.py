"""Full-ranking retrieval (mAP over the whole gallery) by blockwise scoring and one sort per row.

Queries are processed in blocks of B rows so that only a [B, G] score block exists at a time
(numpy: one buffer reused for every block, ranked by threads in chunks of a few rows); B
follows from ``max_memory``. The N x N matrix never exists.

Each row is sorted once (:mod:`featcache.retrieval.sortedrows`): the relevance flags
gathered in the sorted order give every relevant item's rank under both tie rules, the
policy of :mod:`featcache.retrieval.metrics` (``ties="block"``: a tie group ranked as a
block at its last position) and Battle of the Backbones' (``ties="index"``: bob-retrieval
``retrieval/main_ret.py``'s ``torch.argsort(-sim, dim=0)``, read as a stable sort: exact
ties in gallery order). The metrics follow from cumulative counts over those ranks.

Scores: float32 GEMM by default (``exact_scores=False``), as a plain PyTorch loop computes
them. A float32 GEMM rounds a score differently depending on where its query row sits in
the BLAS block, so two items whose scores are within a float32 rounding step may rank in
either order, with another block size, thread count, backend or machine. ``exact_scores``
sums every score in float64 and rounds it once (:func:`featcache.retrieval.search.score_block`):
the same on every machine and block size, at twice the GEMM time (numpy path; the torch
path always scores in float32 on its device).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from featcache.errors import ConfigError
from featcache.retrieval.metrics import RankedRelevance
from featcache.retrieval.prepared import PreparedRows, as_prepared
from featcache.retrieval.search import BACKENDS, DEFAULT_MAX_MEMORY, exact_matmul, rows_per_block, score_block
from featcache.retrieval.sortedrows import SortedRanks, block_metrics, rank_block, rank_sorted, tie_row_ranks

if TYPE_CHECKING:
    from featcache.retrieval.relevance import Relevance

log = logging.getLogger(__name__)

__all__ = ["TIE_RULES", "full_ranking", "full_ranking_metrics"]

#: ``block``: featcache's tie policy (:mod:`featcache.retrieval.metrics`); ``index``: a
#: stable argsort of the negated scores (ties in gallery order, as Battle of the Backbones)
TIE_RULES = ("block", "index")

#: query rows per score block on the CPU: the float32 GEMM runs at full speed from ~256 rows
NUMPY_MAX_BLOCK_ROWS = 256
#: rows a thread sorts at once (their int64 argsort stays within a few MB per thread)
CHUNK_ROWS = 16


def _block_rows(n_q: int, n_g: int, max_memory: int, dev) -> int:
    if dev is None:  # scores (4 B/cell) + per-thread chunk buffers (~14 B x G x CHUNK_ROWS each)
        chunks = min(max_memory // 2, _n_threads() * 14 * CHUNK_ROWS * n_g)
        rows = rows_per_block(n_g, max_memory - chunks, 4)
        return max(1, min(n_q, rows, NUMPY_MAX_BLOCK_ROWS))
    return max(1, min(n_q, rows_per_block(n_g, max_memory, 24)))


def _torch_device(backend: str):
    """The torch device a search backend ranks on (``SearchBackend.ranking_device``; CUDA only
    where it is available), ``None``: numpy."""
    dev = BACKENDS[backend].ranking_device if backend in BACKENDS else None
    if dev is None:
        return None
    import torch

    if dev == "cuda" and not torch.cuda.is_available():
        return None
    return torch.device(dev)


def _n_threads() -> int:
    """Threads ranking a block: the CPUs this process may run on (at most 8)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def concat_ranks(parts: Sequence[SortedRanks]) -> SortedRanks:
    """One :class:`SortedRanks` of consecutive blocks."""
    if len(parts) == 1:
        return parts[0]
    counts = np.concatenate([np.diff(p.indptr) for p in parts])
    indptr = np.zeros(counts.size + 1, np.int64)
    np.cumsum(counts, out=indptr[1:])
    return SortedRanks(
        indptr,
        np.concatenate([p.r_index for p in parts]),
        np.concatenate([p.r_block for p in parts]),
        np.concatenate([p.tp_block for p in parts]),
    )


def _rank_rows(S: np.ndarray, relevance: Relevance, start: int) -> SortedRanks:
    """Ranks of the rows of a score block ``S`` (queries ``start:start + len(S)``), in
    chunks of :data:`CHUNK_ROWS`; ``S`` is negated in place (its excluded items +inf)."""
    parts = []
    for lo in range(0, S.shape[0], CHUNK_ROWS):
        Sc = S[lo : lo + CHUNK_ROWS]
        a, b = start + lo, start + lo + Sc.shape[0]
        np.negative(Sc, out=Sc)
        rows, cols = relevance.excluded_pairs(a, b)
        Sc[rows, cols] = np.inf
        parts.append(rank_block(Sc, relevance.positive_mask(a, b)))
    return concat_ranks(parts)


def _scores(Qb: np.ndarray, G: PreparedRows, metric: str, g_sq, exact: bool, out: np.ndarray) -> np.ndarray:
    """Scores [b, G] into ``out``: :func:`score_block` (``exact``), else one float32 GEMM."""
    if exact:
        return score_block(Qb, G, metric, g_sq, out=out)
    for lo, hi, Gb in G.blocks():
        np.matmul(Qb, Gb.T, out=out[:, lo:hi])
    if metric == "l2":
        out *= 2
        out -= np.einsum("ij,ij->i", Qb, Qb)[:, None]
        out -= g_sq[None, :]
    return out


def _rank_block_torch(St, relevance: Relevance, start: int, stop: int) -> SortedRanks:
    """:func:`~featcache.retrieval.sortedrows.rank_block` on a torch device: the sort and the
    gathered flags there; the relevant items' positions and the few score lookups the tie
    resolution needs travel to the host (:func:`~featcache.retrieval.sortedrows.rank_sorted`)."""
    import torch

    dev = St.device
    b, n = St.shape
    neg = torch.neg(St)
    rows, cols = relevance.excluded_pairs(start, stop)
    if rows.size:
        neg[torch.from_numpy(rows).to(dev), torch.from_numpy(cols).to(dev)] = float("inf")
    pos_np = relevance.positive_mask(start, stop)
    order = torch.argsort(neg, dim=1)
    r, c = torch.nonzero(torch.gather(torch.from_numpy(pos_np).to(dev), 1, order), as_tuple=True)
    of, sf = order.reshape(-1), neg.reshape(-1)

    def idx(p):
        return of[torch.from_numpy(p).to(dev)].cpu().numpy()

    def val(p):
        pt = torch.from_numpy(p).to(dev)
        return sf[(pt // n) * n + of[pt]].cpu().numpy()

    def tie_row(i):
        return tie_row_ranks(neg[i].cpu().numpy(), pos_np[i])

    return rank_sorted(b, n, r.cpu().numpy(), c.cpu().numpy(), val, idx, tie_row)


def _blocks(Q, G, relevance, metric, B, dev, progress, exact: bool):
    """Yield ``(start, stop, SortedRanks)`` per block of B queries."""
    from concurrent.futures import ThreadPoolExecutor

    from featcache.core.progress import tqdm

    n_q, n_g = Q.shape[0], G.shape[0]
    if dev is not None:
        import torch

        Gt = G.to_torch(dev)
        g_sq_t = (Gt * Gt).sum(1) if metric == "l2" else None
    g_sq = G.sq_norms() if metric == "l2" and dev is None else None
    how = f"torch {dev}" if dev is not None else f"numpy, {'float64-rounded' if exact else 'float32'} scores"
    log.info("full ranking: %d queries x %d gallery, blocks of %d rows (%s)", n_q, n_g, B, how)
    n_threads = _n_threads() if dev is None else 1
    buf = np.empty((B, n_g), np.float32) if dev is None else None  # one score block, reused
    with ThreadPoolExecutor(n_threads) as pool:
        for start in tqdm(range(0, n_q, B), desc="full ranking", unit="block", disable=not progress):
            stop = min(n_q, start + B)
            if dev is not None:
                Qb = torch.from_numpy(Q.block(start, stop)).to(dev)
                St = Qb @ Gt.T
                if g_sq_t is not None:  # metric == "l2"
                    St = 2 * St - (Qb * Qb).sum(1)[:, None] - g_sq_t[None, :]
                yield start, stop, _rank_block_torch(St, relevance, start, stop)
                del St
                continue
            assert buf is not None  # allocated for the numpy path
            S = _scores(Q.block(start, stop), G, metric, g_sq, exact, buf[: stop - start])
            bounds = np.linspace(0, stop - start, n_threads + 1).astype(int)
            parts = [(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds) if hi > lo]
            futures = [pool.submit(_rank_rows, S[lo:hi], relevance, start + lo) for lo, hi in parts]
            yield start, stop, concat_ranks([f.result() for f in futures])


def _setup(Q, G, metric, backend, max_memory, ties="block"):
    if ties not in TIE_RULES:
        raise ConfigError(f"ties must be one of {', '.join(TIE_RULES)}; got {ties!r}")
    Q, G = as_prepared(Q, metric), as_prepared(G, metric)
    dev = _torch_device(backend)
    return Q, G, dev, _block_rows(Q.shape[0], G.shape[0], max_memory, dev)


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
    exact_scores: bool = False,
) -> RankedRelevance:
    """Ranks of every relevant item of every query over the whole gallery.

    ``Q``, ``G``: features already prepared (:func:`featcache.retrieval.search.prepare`),
    or :class:`~featcache.retrieval.prepared.PreparedRows` (a streamed gallery is scored
    block by block; on a GPU its blocks fill one device tensor).
    ``backend``: ``torch-cuda``/``faiss-gpu`` score, sort and gather each block on the GPU
    (torch; ``torch-cpu`` runs that code on the CPU), anything else on the CPU with numpy.
    Memory: one float32 score block of at most 256 rows (numpy; plus a few G-sized chunk
    buffers per thread) or about 24 bytes x G per query row (torch); ``max_memory`` bounds
    the block. ``ties``: one of :data:`TIE_RULES`. ``exact_scores``: float64-rounded
    scores (numpy path; see the module docstring).
    """
    Q, G, dev, B = _setup(Q, G, metric, backend, max_memory, ties)
    with exact_matmul() if dev is not None else _nothing():
        parts = [sr for _, _, sr in _blocks(Q, G, relevance, metric, B, dev, progress, exact_scores)]
    sr = concat_ranks(parts) if parts else SortedRanks(*(np.zeros(n, np.int64) for n in (1, 0, 0, 0)))
    return sr.ranked(relevance.n_relevant(), ties)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
    exact_scores: bool = False,
    bob: bool = False,
) -> dict[str, np.ndarray]:
    """Per-query metrics of the full ranking (``map``, ``mrr`` and every @k metric), equal to
    ``compute_metrics(full_ranking(...), ks)``, computed block by block from one sort per
    row: memory O(block x G), nothing kept per relevant item.

    ``bob``: also Battle of the Backbones' per query from the same sort (``map_bob``,
    ``mp@k`` and ``rr_bob``, the reciprocal rank of the first positive, 0 without one:
    :func:`~featcache.retrieval.revisited.bob_mrr` is its sum over all queries / their number).
    """
    ks = sorted({int(k) for k in ks})
    Q, G, dev, B = _setup(Q, G, metric, backend, max_memory)
    n_rel = relevance.n_relevant()
    out: dict[str, list[np.ndarray]] = {}
    with exact_matmul() if dev is not None else _nothing():
        for start, stop, sr in _blocks(Q, G, relevance, metric, B, dev, progress, exact_scores):
            for name, v in block_metrics(sr, n_rel[start:stop], ks, bob).items():
                out.setdefault(name, []).append(v)
    if not out:  # no query
        empty = SortedRanks(*(np.zeros(n, np.int64) for n in (1, 0, 0, 0)))
        return block_metrics(empty, n_rel[:0], ks, bob)
    return {name: np.concatenate(v) for name, v in out.items()}
