"""Exact top-k over a gallery sharded across Dask workers (a ``dask.distributed`` LocalCluster
on loopback by default, or a scheduler address): each worker reads its shard of gallery rows
from the store itself (the driver never holds the gallery's features), searches it exactly
with the same backend and tie policy as the single-process path, and the driver merges the
shards' lists. Each shard's list is exact to the search depth under the tie policy (score
desc, gallery index asc), so the merged list is the single-process one, item for item.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from featcache.retrieval.prepared import MIN_BLOCK_ROWS, PreparedRows
from featcache.retrieval.search import drop_excluded, parse_memory, policy_sort, search_depth, topk

if TYPE_CHECKING:
    from featcache.retrieval.relevance import Relevance

log = logging.getLogger(__name__)

__all__ = ["GallerySource", "dask_client", "shard_bounds", "sharded_topk"]


@dataclass(frozen=True)
class GallerySource:
    """Where a worker reads gallery rows: a store, a feature group, and the stored row of each
    gallery position (the valid rows)."""

    cache: str
    backbone: str
    dataset: str
    split: str
    kind: str
    rows: np.ndarray  # stored row index of gallery position i

    @property
    def n(self) -> int:
        return int(self.rows.size)


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal shards of ``n`` gallery positions; at most as many as keep each
    >= MIN_BLOCK_ROWS / 2 rows (BLAS's small-matrix kernels would change scores' last bits)."""
    most = max(1, n // max(1, MIN_BLOCK_ROWS // 2))
    s = max(1, min(int(shards), most))
    edges = np.linspace(0, n, s + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def _shard_search(src: GallerySource, lo: int, hi: int, Q: np.ndarray, depth: int, metric: str, backend: str, mem: int):
    """(scores, global indices) of one shard: its exact top-depth under the tie policy."""
    from featcache.store import open_cache

    f = open_cache(src.cache).load(src.backbone, src.dataset, src.split, src.kind, dtype=None, lazy=True, check=False)  # pyright: ignore[reportArgumentType] (None: the stored dtype)
    X = np.asarray(f.X[src.rows[lo:hi]])
    G = PreparedRows(X, metric, cache_bytes=mem // 4)
    Qp = PreparedRows(Q, metric, prepared=True)
    sc, ix, used = topk(Qp, G, min(depth, hi - lo), metric, backend=backend, max_memory=mem, prepared=True)
    return sc, np.where(ix >= 0, ix + lo, -1), used


def dask_client(scheduler: str | None, workers: int, processes: bool = True) -> tuple[Any, Any]:
    """A Client on ``scheduler``, or on a LocalCluster of ``workers`` (loopback, one thread
    each) that the caller closes; returns ``(client, cluster or None)``."""
    from dask.distributed import Client, LocalCluster

    from featcache.errors import BackendUnavailableError

    if scheduler:
        try:
            return Client(scheduler, timeout="30s"), None
        except (OSError, TimeoutError) as exc:
            raise BackendUnavailableError(
                f"no Dask scheduler answers at {scheduler} ({exc}); start one (`dask scheduler`, "
                "`dask worker ADDRESS`) or drop --scheduler for a local cluster"
            ) from exc
    cluster = LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=processes,
        host="127.0.0.1",
        protocol="tcp://",  # loopback TCP for thread workers too (their default, inproc, takes no host)
        dashboard_address=None,  # pyright: ignore[reportArgumentType] (None: no dashboard)
    )
    return Client(cluster), cluster


def sharded_topk(
    Q: PreparedRows,
    src: GallerySource,
    k: int,
    metric: str,
    client: Any,
    shards: int,
    *,
    relevance: Relevance | None = None,
    backend: str = "auto",
    max_memory: int | str = "2GB",
) -> tuple[np.ndarray, np.ndarray, str]:
    """:func:`~featcache.retrieval.topk` of ``Q`` against the gallery ``src``, searched in
    ``shards`` shards on ``client``'s workers and merged exactly."""
    mem = parse_memory(max_memory)
    depth = search_depth(k, src.n, relevance)
    bounds = shard_bounds(src.n, shards)
    log.info("searching %d gallery rows in %d shard(s) on Dask workers", src.n, len(bounds))
    q = client.scatter(Q.array(), hash=False)  # once; each worker fetches it from its holder
    futs = [client.submit(_shard_search, src, lo, hi, q, depth, metric, backend, mem, pure=False) for lo, hi in bounds]
    parts = client.gather(futs)
    sc = np.concatenate([p[0] for p in parts], axis=1)
    ix = np.concatenate([p[1] for p in parts], axis=1)
    sc, ix = policy_sort(sc, ix)
    sc, ix = sc[:, :depth], ix[:, :depth]
    sc, ix, _ = drop_excluded(sc, ix, k, relevance)
    used = sorted({p[2] for p in parts})
    return sc, ix, ",".join(used)


def shard_rows(bounds: Sequence[tuple[int, int]]) -> list[int]:
    """Rows per shard (for hparams)."""
    return [hi - lo for lo, hi in bounds]
