"""Exact top-k search: FAISS (GPU when ``faiss.get_num_gpus() > 0``, else CPU) or a torch
GEMM + top-k path (CUDA machines without faiss-gpu), all giving the same lists.

Scores are "higher is better" everywhere: cosine and inner-product similarities as they are,
and ``-||q - g||^2`` for L2. Lists are ordered by (score desc, gallery index asc): every
backend's output is re-sorted with this key, excluded items (the query itself, junk) are
removed, and the rare rows where equal scores straddle the search depth are recomputed
exactly (numpy, full row), so the list never depends on how a backend orders equal scores.
Metrics then rank tie groups as blocks (:mod:`featcache.retrieval.metrics`); k-NN takes the
first k entries of the list.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.core.memory import parse_memory as _parse_memory
from featcache.core.optional import import_faiss
from featcache.core.registry import Registry
from featcache.errors import BackendUnavailableError, DataError
from featcache.retrieval.prepared import METRICS, PreparedRows, as_prepared, prepare, prepared_pair

if TYPE_CHECKING:
    from featcache.retrieval.relevance import Relevance

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "FAISS_GPU_MAX_K",
    "METRICS",
    "SearchBackend",
    "choose_backend",
    "drop_excluded",
    "parse_memory",
    "prepare",
    "prepared_pair",
    "raw_search",
    "score_block",
    "search_depth",
    "topk",
]

#: largest k faiss-gpu's exact search selects (GPU_MAX_SELECTION_K)
FAISS_GPU_MAX_K = 2048
#: query blocks scored on the CPU are padded to this many rows (see score_block)
MIN_QUERY_ROWS = 16
DEFAULT_MAX_MEMORY = 2 * 1024**3


def parse_memory(text: str | int | float | None) -> int:
    """``"2GB"``, ``"512MiB"``, ``"1e9"``, ``1000000`` -> bytes; ``None``: the default 2 GiB
    (:func:`featcache.core.memory.parse_memory`, refusing with a :class:`DataError`)."""
    return _parse_memory(text, name="max memory", error=DataError, default=DEFAULT_MAX_MEMORY)


def _faiss():
    return import_faiss()  # raises BackendUnavailableError, or DependencyConflictError (cpu + gpu builds)


def _cuda_available() -> bool:
    import os
    import sys

    if "torch" not in sys.modules and not any(
        os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")
    ):
        return False  # no NVIDIA driver: skip importing torch (seconds) just to learn that
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _faiss_gpus() -> int:
    try:
        faiss = import_faiss()
    except BackendUnavailableError:
        return 0
    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get else 0


def _choose_auto(k: int | None, streamed: bool) -> str:
    """``auto``: faiss-gpu if faiss sees a GPU (and k <= 2048), else torch on CUDA, else faiss
    on the CPU, or numpy for ``streamed`` features (a flat FAISS index would hold their whole
    float32 copy)."""
    if _faiss_gpus() > 0 and (k is None or k <= FAISS_GPU_MAX_K):
        chosen = "faiss-gpu"
    elif _cuda_available():
        chosen = "torch-cuda"
        if _faiss_gpus() > 0:
            log.info("k=%s exceeds faiss-gpu's limit %d; using the torch CUDA path", k, FAISS_GPU_MAX_K)
    else:
        try:
            _faiss()
            chosen = "faiss-cpu"
        except BackendUnavailableError:
            chosen = "numpy"
        if chosen == "faiss-cpu" and streamed:
            log.info("features streamed: searching with numpy (FAISS would hold them whole in float32)")
            chosen = "numpy"
    no_gpu = " (no CUDA GPU found; CPU fallback)" if chosen in ("faiss-cpu", "numpy") else ""
    log.info("retrieval search backend: %s%s", chosen, no_gpu)
    return chosen


def _check_faiss_gpu(k: int | None, streamed: bool) -> str:
    if _faiss_gpus() == 0:
        raise BackendUnavailableError("faiss-gpu requested but faiss sees no GPU; use --backend auto or faiss-cpu")
    if k is not None and k > FAISS_GPU_MAX_K:
        fallback = "torch-cuda" if _cuda_available() else "faiss-cpu"
        log.warning("k=%d exceeds faiss-gpu's limit %d; searching with %s instead", k, FAISS_GPU_MAX_K, fallback)
        return fallback
    return "faiss-gpu"


def _check_torch_cuda(k: int | None, streamed: bool) -> str:
    if not _cuda_available():
        raise BackendUnavailableError("torch-cuda requested but CUDA is not available; use --backend auto")
    return "torch-cuda"


def choose_backend(backend: str = "auto", k: int | None = None, streamed: bool = False) -> str:
    """The backend that searches for ``backend`` (a name in :data:`BACKENDS`): its entry's
    ``choose`` resolves ``auto``, refuses what this machine cannot run and falls back past a
    limit (faiss-gpu's k <= 2048); the choice is logged."""
    if backend not in BACKENDS:
        raise DataError(BACKENDS.unknown(backend))
    be = BACKENDS[backend]
    if be.choose is not None:
        chosen = be.choose(k, streamed)
        if backend == "auto" or chosen != backend:  # auto and a fallback log their own line
            return chosen
    log.info("retrieval search backend: %s", backend)
    return backend


def rows_per_block(n_gallery: int, max_memory: int, bytes_per_cell: int = 12) -> int:
    return max(1, int(max_memory // max(1, n_gallery * bytes_per_cell)))


#: gallery rows per float64 product (bounds the float64 copy: 8,192 x D x 8 bytes)
_PRODUCT_ROWS = 8192


def _products(Qb: np.ndarray, Gb: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[...] = Qb @ Gb.T``, summed in float64 and rounded once to float32.

    A float32 GEMM sums a score in an order that depends on where its row sits in the block
    (OpenBLAS's Haswell kernels, one thread: 3 % of the scores of the same 16 query rows differ
    in the last bit between rows 0-15 and rows 16-31 of a block), so held, streamed and padded
    blocks would rank near-ties differently. float32 products are exact in float64, and the
    float64 sums, whatever their order, round to the same float32 (0 of those scores differ)."""
    q = Qb.astype(np.float64)
    for lo in range(0, Gb.shape[0], _PRODUCT_ROWS):
        hi = min(lo + _PRODUCT_ROWS, Gb.shape[0])
        out[:, lo:hi] = q @ Gb[lo:hi].astype(np.float64).T
    return out


def score_block(
    Qb: np.ndarray,
    G: np.ndarray | PreparedRows,
    metric: str,
    g_sq: np.ndarray | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Exact scores [B, G] (numpy float32): similarity, or ``-||q-g||^2`` for l2.

    ``G``: prepared float32 rows, or :class:`PreparedRows` (a streamed gallery is scored
    block by block into the columns of the result). ``out``: a float32 [B, G] buffer to
    write into (reused across blocks, so a large block is not page-faulted in afresh).
    Fewer than 16 query rows are padded with zero rows: BLAS would take its one-row or
    small-matrix kernels, whose sums differ in the last bit from a large block's."""
    if 0 < Qb.shape[0] < MIN_QUERY_ROWS:
        padded = np.zeros((MIN_QUERY_ROWS, Qb.shape[1]), np.float32)
        padded[: Qb.shape[0]] = Qb
        S = score_block(padded, G, metric, g_sq)[: Qb.shape[0]]
        if out is None:
            return S
        out[...] = S
        return out
    if isinstance(G, PreparedRows):
        if out is None:
            out = np.empty((Qb.shape[0], G.shape[0]), np.float32)
        for lo, hi, Gb in G.blocks():
            _products(Qb, Gb, out[:, lo:hi])
        S = out
        if metric == "l2" and g_sq is None:
            g_sq = G.sq_norms()
    else:
        S = _products(Qb, G, np.empty((Qb.shape[0], G.shape[0]), np.float32) if out is None else out)
        if metric == "l2" and g_sq is None:
            g_sq = np.einsum("ij,ij->i", G, G)
    if metric == "l2":
        assert g_sq is not None  # computed above for l2
        q_sq = np.einsum("ij,ij->i", Qb, Qb)
        S *= 2
        S -= q_sq[:, None]
        S -= g_sq[None, :]
    return S


def _pad(sc: np.ndarray, ix: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if sc.shape[1] >= k:
        return sc, ix
    n = k - sc.shape[1]
    sc = np.concatenate([sc, np.full((sc.shape[0], n), -np.inf, np.float32)], axis=1)
    ix = np.concatenate([ix, np.full((ix.shape[0], n), -1, np.int64)], axis=1)
    return sc, ix


def _search_faiss(Q: PreparedRows, G: PreparedRows, k, metric, gpu: bool):
    """FAISS flat search. The index holds its own float32 copy of the gallery (added block
    by block), and the queries go in one call: FAISS's scores depend on how many queries
    a call holds, so blocks of them would change the last bits."""
    faiss = _faiss()
    d = G.shape[1]
    index = faiss.IndexFlatL2(d) if metric == "l2" else faiss.IndexFlatIP(d)
    if gpu:
        if faiss.get_num_gpus() <= 0:  # never move an index to a GPU that is not there
            raise BackendUnavailableError("faiss sees no GPU")
        res = faiss.StandardGpuResources()
        index = faiss.index_cpu_to_gpu(res, 0, index)
    for _, _, Gb in G.blocks():
        index.add(Gb)
    kk = min(k, G.shape[0])
    sc, ix = index.search(Q.array(), kk)
    ix = ix.astype(np.int64)
    sc = -sc if metric == "l2" else sc
    sc = np.where(ix < 0, -np.inf, sc).astype(np.float32)
    return _pad(sc, ix, k)


class exact_matmul:
    """Context: float32 matmuls in full precision (no TF32), restoring the caller's setting."""

    def __enter__(self):
        import torch

        self._old = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        return self

    def __exit__(self, *exc):
        import torch

        torch.set_float32_matmul_precision(self._old)
        return False


def _bar(n_queries: int, progress: bool):
    """A tqdm bar over the queries (a no-op when ``progress`` is False)."""
    from featcache.core.progress import tqdm

    return tqdm(total=n_queries, desc="top-k search", unit="query", disable=not progress, leave=False)


def _search_torch(Q, G, k, metric, device: str, max_memory: int, bar=None):
    with exact_matmul():
        return _search_torch_inner(Q, G, k, metric, device, max_memory, bar)


def _search_torch_inner(Q, G, k, metric, device: str, max_memory: int, bar=None):
    import torch

    dev = torch.device(device)
    Gt = G.to_torch(dev)
    g_sq = (Gt * Gt).sum(1) if metric == "l2" else None
    kk = min(k, G.shape[0])
    B = rows_per_block(G.shape[0], max_memory, 8)
    Ds, Is = [], []
    for s in range(0, Q.shape[0], B):
        Qb = torch.from_numpy(Q.block(s, s + B)).to(dev)
        S = Qb @ Gt.T
        if metric == "l2":
            assert g_sq is not None  # computed above for l2
            S = 2 * S - (Qb * Qb).sum(1)[:, None] - g_sq[None, :]
        v, i = torch.topk(S, kk, dim=1, largest=True, sorted=True)
        Ds.append(v.cpu().numpy().astype(np.float32))
        Is.append(i.cpu().numpy().astype(np.int64))
        del S
        if bar is not None:
            bar.update(Qb.shape[0])
    sc = np.concatenate(Ds) if Ds else np.zeros((0, kk), np.float32)
    ix = np.concatenate(Is) if Is else np.zeros((0, kk), np.int64)
    return _pad(sc, ix, k)


#: float32 unit roundoff: a float32 dot product of D terms, summed in any order, is within
#: D*u/(1-D*u) * sum|q_i g_i| <= that * |q| |g| of the exact one (Higham, Accuracy and
#: Stability of Numerical Algorithms, 2nd ed., eq. 3.5)
_U32 = 2.0**-24


def _float32_error_bound(d: int, q_norm: np.ndarray, g_norm_max: float) -> np.ndarray:
    """Per query: twice the largest gap between a float32 GEMM score and the exact score
    rounded to float32 (``2 (gamma_D + u) |q| max|g|``, with 1 % slack for the norms' own
    rounding), so a row scoring that far below the k-th float32 score is out of the top k."""
    gamma = d * _U32 / (1 - d * _U32)
    return 2.02 * (gamma + _U32) * q_norm * g_norm_max


#: candidates a query may have for float64 rescoring (beyond it, e.g. thousands of exact
#: ties at the k-th score, the row is scored whole in float64: memory stays bounded)
MAX_CANDIDATES = 4096


def _topk_float64(Qb: np.ndarray, G, kk: int, metric: str, g_sq=None) -> tuple[np.ndarray, np.ndarray]:
    """Top ``kk`` of every :func:`score_block` score (order among ties free)."""
    S = score_block(Qb, G, metric, g_sq)
    if kk < S.shape[1]:
        part = np.argpartition(-S, kk - 1, axis=1)[:, :kk]
    else:
        part = np.broadcast_to(np.arange(S.shape[1]), S.shape).copy()
    return np.take_along_axis(S, part, axis=1), part


def _topk_rescored(
    Qb: np.ndarray, G: PreparedRows, kk: int, g_norm_max: float, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """Top ``kk`` of inner-product scores, [B, kk] scores and indices (order among ties
    free), equal to :func:`_topk_float64`'s: the float32 GEMM (half the time and no float64
    copy of the gallery) only picks the candidates within its error bound of the k-th
    score, which are then scored in float64 and rounded once, as score_block does."""
    S = np.empty((Qb.shape[0], G.shape[0]), np.float32)
    for lo, hi, Gb in G.blocks():
        np.matmul(Qb, Gb.T, out=S[:, lo:hi])
    kth = np.partition(S, S.shape[1] - kk, axis=1)[:, S.shape[1] - kk]
    Q64 = Qb.astype(np.float64)
    q_norm = np.linalg.norm(Q64, axis=1)
    mask = np.greater_equal(S, (kth - _float32_error_bound(Qb.shape[1], q_norm, g_norm_max))[:, None])
    del S
    heavy = mask.sum(1) > max(MAX_CANDIDATES, 2 * kk)
    sc, ix = np.empty((Qb.shape[0], kk), np.float32), np.empty((Qb.shape[0], kk), np.int64)
    if heavy.any():
        sc[heavy], ix[heavy] = _topk_float64(Qb[heavy], G, kk, metric)
    light = np.flatnonzero(~heavy)
    r, c = np.nonzero(mask[light])
    del mask
    cols, inv = np.unique(c, return_inverse=True)
    exact = np.einsum("ij,ij->i", Q64[light][r], G.take(cols).astype(np.float64)[inv]).astype(np.float32)
    o = np.lexsort((c, -exact, r))  # by row, then the tie policy
    take = (np.searchsorted(r[o], np.arange(light.size))[:, None] + np.arange(kk)[None, :]).ravel()
    sc[light], ix[light] = exact[o][take].reshape(-1, kk), c[o][take].reshape(-1, kk)
    return sc, ix


def _gallery_norm_max(G: PreparedRows, metric: str) -> float:
    """An upper bound of the gallery rows' norms (cosine rows are unit or zero)."""
    if metric == "cosine":
        return 1.0 + 1e-3
    return float(np.sqrt(np.max(G.sq_norms(), initial=0.0))) * (1 + 1e-3)


def _search_numpy(Q, G, k, metric, max_memory: int, bar=None):
    kk = min(k, G.shape[0])
    B = rows_per_block(G.shape[0], max_memory, 12)
    g_sq = G.sq_norms() if metric == "l2" else None
    rescore = metric != "l2" and kk < G.shape[0]  # l2: the float64 scores of every row
    g_max = _gallery_norm_max(G, metric) if rescore else 0.0
    Ds, Is = [], []
    for s in range(0, Q.shape[0], B):
        Qb = Q.block(s, s + B)
        if rescore:
            v, part = _topk_rescored(Qb, G, kk, g_max, metric)
        else:
            v, part = _topk_float64(Qb, G, kk, metric, g_sq)
        o = np.lexsort((part, -v), axis=1)
        Ds.append(np.take_along_axis(v, o, axis=1))
        Is.append(np.take_along_axis(part, o, axis=1).astype(np.int64))
        if bar is not None:
            bar.update(Qb.shape[0])
    sc = np.concatenate(Ds) if Ds else np.zeros((0, kk), np.float32)
    ix = np.concatenate(Is) if Is else np.zeros((0, kk), np.int64)
    return _pad(sc, ix, k)


def raw_search(
    Q: np.ndarray | PreparedRows,
    G: np.ndarray | PreparedRows,
    k: int,
    metric: str,
    backend: str,
    max_memory: int = DEFAULT_MAX_MEMORY,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Backend top-k: scores [Q, k] (higher is better, -inf where missing) and gallery
    indices [Q, k] (-1 where missing, as FAISS returns for k > gallery). Order among equal
    scores is backend-defined; :func:`topk` fixes it. ``progress``: a bar over the query
    blocks (FAISS searches all queries in one call, so its bar moves once). ``Q``, ``G``:
    prepared float32 arrays or :class:`PreparedRows`."""
    Q, G = as_prepared(Q, metric), as_prepared(G, metric)
    be = BACKENDS.get(backend)
    if be is None or be.search is None:
        raise DataError(f"unknown backend {backend!r}; give a searching one of {', '.join(searching_backends())}")
    with _bar(Q.shape[0], progress) as bar:
        return be.search(Q, G, k, metric, max_memory, bar)


def searching_backends() -> list[str]:
    """The backends that search (every name in :data:`BACKENDS` but ``auto``)."""
    return [e.name for e in BACKENDS.entries() if e.name != "auto"]


@dataclass(frozen=True)
class SearchBackend:
    """One ``--backend`` of the exact search. ``search(Q, G, k, metric, max_memory, bar)``:
    top-k of :class:`PreparedRows` as :func:`raw_search` returns them (order among equal scores
    free; ``bar.update(n)`` per query rows done); ``None`` for a name that only chooses
    (``auto``). ``choose(k, streamed)``: the backend that runs for this request, raising
    :class:`BackendUnavailableError` for one this machine lacks (``None``: itself, always).
    ``ranking_device``: the torch device the full ranking (``--full``) runs on when this
    backend is chosen (``"cuda"`` falls back to numpy without CUDA; ``None``: numpy)."""

    search: Callable[..., tuple[np.ndarray, np.ndarray]] | None
    choose: Callable[[int | None, bool], str] | None = None
    ranking_device: str | None = None


def _faiss_search(gpu: bool) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    def search(Q: Any, G: Any, k: int, metric: str, max_memory: int, bar: Any) -> tuple[np.ndarray, np.ndarray]:
        out = _search_faiss(Q, G, k, metric, gpu=gpu)
        bar.update(Q.shape[0])  # FAISS searches every query in one call
        return out

    return search


def _torch_search(device: str) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    def search(Q: Any, G: Any, k: int, metric: str, max_memory: int, bar: Any) -> tuple[np.ndarray, np.ndarray]:
        return _search_torch(Q, G, k, metric, device, max_memory, bar)

    return search


#: the ``--backend`` words of the exact search, in help order (a new one: ``BACKENDS.register(
#: name, SearchBackend(search, choose))`` in its own module, or ``"module:attr"`` imported on first use)
BACKENDS: Registry[SearchBackend] = Registry("search backend", DataError)
BACKENDS.register("auto", SearchBackend(None, _choose_auto), note="the fastest this machine has")
BACKENDS.register("faiss-gpu", SearchBackend(_faiss_search(gpu=True), _check_faiss_gpu, "cuda"))
BACKENDS.register("torch-cuda", SearchBackend(_torch_search("cuda"), _check_torch_cuda, "cuda"))
BACKENDS.register("faiss-cpu", SearchBackend(_faiss_search(gpu=False)))
BACKENDS.register("torch-cpu", SearchBackend(_torch_search("cpu"), ranking_device="cpu"))
BACKENDS.register("numpy", SearchBackend(_search_numpy))


def policy_sort(sc: np.ndarray, ix: np.ndarray):
    key = np.where(ix < 0, np.iinfo(np.int64).max, ix)
    o = np.lexsort((key, -sc), axis=1)
    return np.take_along_axis(sc, o, axis=1), np.take_along_axis(ix, o, axis=1)


def _exact_rows(Q, G, rows, k, metric, relevance, max_memory):
    """Exact top-k of some query rows with the tie policy (numpy, full rows)."""
    sc = np.full((rows.size, k), -np.inf, np.float32)
    ix = np.full((rows.size, k), -1, np.int64)
    B = rows_per_block(G.shape[0], max_memory, 12)
    for s in range(0, rows.size, B):
        rb = rows[s : s + B]
        S = score_block(Q.take(rb), G, metric)
        for j, r in enumerate(rb):
            keep = np.ones(G.shape[0], bool)
            if relevance is not None:
                keep[relevance.excluded(int(r))] = False
            idx = np.flatnonzero(keep)
            order = idx[np.lexsort((idx, -S[j, idx]))][:k]
            sc[s + j, : order.size] = S[j, order]
            ix[s + j, : order.size] = order
    return sc, ix


def search_depth(k: int, n_gallery: int, relevance: Relevance | None) -> int:
    """How deep a search goes for ``k`` kept items: k, the most items a query excludes, and
    one more (a tie group crossing the depth is seen)."""
    n_ex = relevance.max_excluded() if relevance is not None else 0
    return min(n_gallery, k + n_ex + 1)


def drop_excluded(
    sc: np.ndarray, ix: np.ndarray, k: int, relevance: Relevance | None, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Policy-sorted lists with excluded items (the query itself, junk) removed, cut or padded
    to ``k`` (index -1, score -inf where short); also the kept count per row. ``rows``: the
    relevance's query row of each list (default 0, 1, ...)."""
    if relevance is not None and relevance.max_excluded():
        q = np.arange(sc.shape[0]) if rows is None else np.asarray(rows, np.int64)
        rows = np.broadcast_to(q[:, None], ix.shape)
        ex = relevance.is_excluded(rows, ix)
        o = np.argsort(ex, axis=1, kind="stable")
        sc, ix = np.take_along_axis(sc, o, axis=1), np.take_along_axis(ix, o, axis=1)
        n_kept = (~ex).sum(1)
    else:
        n_kept = np.full(sc.shape[0], sc.shape[1])
    sc, ix = _pad(sc, ix, k)
    sc, ix = sc[:, :k].copy(), ix[:, :k].copy()
    short = np.arange(k)[None, :] >= n_kept[:, None]
    sc[short], ix[short] = -np.inf, -1
    return sc, ix, n_kept


def topk(
    Q: np.ndarray | PreparedRows,
    G: np.ndarray | PreparedRows,
    k: int,
    metric: str = "cosine",
    *,
    relevance: Relevance | None = None,
    backend: str = "auto",
    max_memory: int | str = DEFAULT_MAX_MEMORY,
    prepared: bool = False,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray, str]:
    """Top-k gallery items of every query under the tie policy, excluded items removed
    (``progress``: a bar over the query blocks).

    ``Q``, ``G``: features (``prepared=True``: already :func:`prepare`-d float32), or
    :class:`PreparedRows`; features whose float32 copy exceeds a quarter of ``max_memory``
    are streamed block by block (host memory bounded with ``numpy`` and the CUDA backends;
    ``torch-cpu`` and ``faiss-cpu`` hold one whole float32 copy in host memory, so ``auto``
    then takes ``numpy`` on a CPU). Returns ``(scores [Q, k], indices [Q, k], backend)``;
    missing results (k larger than the gallery) have index -1 and score -inf.
    """
    if k < 1:
        raise DataError(f"k must be >= 1, got {k}")
    max_memory = parse_memory(max_memory)
    if not prepared:
        Q, G = prepared_pair(Q, G, metric, cache_bytes=max_memory // 4)
    Q, G = as_prepared(Q, metric), as_prepared(G, metric)
    if Q.shape[1] != G.shape[1]:
        raise DataError(f"query dim {Q.shape[1]} != gallery dim {G.shape[1]}; use features of one backbone")
    n_g = G.shape[0]
    depth = search_depth(k, n_g, relevance)
    backend = choose_backend(backend, depth, streamed=Q.streamed or G.streamed)
    sc, ix = raw_search(Q, G, depth, metric, backend, max_memory, progress)
    sc, ix = policy_sort(sc, ix)
    last = sc[:, -1].copy()  # every item scoring above this was returned
    sc, ix, n_kept = drop_excluded(sc, ix, k, relevance)
    if depth < n_g:
        # items scoring exactly the last searched score may have been cut by the backend in
        # another order than the tie policy: recompute those rows exactly
        redo = np.flatnonzero((n_kept < k) | (sc[:, -1] <= last))
        if redo.size:
            log.debug("%d row(s) with a tie at the search depth recomputed exactly", redo.size)
            sc[redo], ix[redo] = _exact_rows(Q, G, redo, k, metric, relevance, max_memory)
    return sc, ix, backend
