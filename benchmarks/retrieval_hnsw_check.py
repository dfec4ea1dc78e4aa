"""Why HNSW32 scores a higher mAP@10 than exact search on the synthetic retrieval store.

``retrieval_index.py`` measured HNSW32 (efSearch 64) at mAP@10 0.1305 against exact 0.0888 on
its 20,000 x 2048 synthetic gallery. This script repeats that comparison with FAISS alone
(``IndexFlatIP`` against ``IndexHNSWFlat``, inner product on L2-normalised rows, as featcache's
cosine) and a brute-force mAP@10 written here, no featcache code in the path: if the gap is
still there, it is the data and the index, not featcache's metrics.

    python benchmarks/retrieval_hnsw_check.py --rows 20000 --json benchmarks/results/retrieval_hnsw_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _normalised(X: np.ndarray) -> np.ndarray:
    X = X.astype(np.float32)
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def map_at_10(ix: np.ndarray, yq: np.ndarray, yg: np.ndarray, n_rel: np.ndarray) -> tuple[float, float]:
    """Mean AP@10 (sum of precision@i at the hits / min(10, relevant)) and mean precision@10."""
    rel = yg[ix] == yq[:, None]
    prec = np.cumsum(rel, 1) / np.arange(1, ix.shape[1] + 1)
    return float(((prec * rel).sum(1) / np.minimum(10, n_rel[yq])).mean()), float(rel.mean())


def run(rows: int, queries: int, dim: int, classes: int, ef_search: int, chunk_rows: int = 8192) -> dict:
    import faiss

    sys.path.insert(0, HERE)
    from probe_scale import stored_rows  # the rows of retrieval_index.py's store

    G, yg = stored_rows(0, 0, rows, dim, classes, 0.15, chunk_rows)
    Q, yq = stored_rows(0, rows, queries, dim, classes, 0.15, chunk_rows)
    G, Q = _normalised(G), _normalised(Q)
    n_rel = np.bincount(yg, minlength=classes)
    out: dict = {"rows": rows, "queries": queries, "dim": dim, "classes": classes, "ef_search": ef_search}
    out["chunk_rows"] = chunk_rows
    flat = faiss.IndexFlatIP(dim)
    flat.add(G)
    hnsw = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
    t = time.perf_counter()
    hnsw.add(G)
    out["hnsw_add_s"] = time.perf_counter() - t
    hnsw.hnsw.efSearch = ef_search
    (se, ie), (sh, ih) = flat.search(Q, 10), hnsw.search(Q, 10)
    out["recall@10"] = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ih, ie)]))
    for name, ix, sc in (("exact", ie, se), ("HNSW32", ih, sh)):
        m, p = map_at_10(ix, yq, yg, n_rel)
        out[name] = {"map@10": m, "precision@10": p, "mean_score": float(sc.mean())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--ef-search", type=int, default=64)
    ap.add_argument(
        "--chunk-rows", type=int, default=8192, help="draw the gallery per chunk of this many rows, as write_store does"
    )
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    out = run(a.rows, a.queries, a.dim, a.classes, a.ef_search, a.chunk_rows)
    out["uptime"] = os.popen("uptime").read().strip()
    print(json.dumps(out, indent=1))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
