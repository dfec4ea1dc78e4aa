"""Retrieval speed benchmark (issue 5): Fashion-MNIST test (10,000 queries) against train
(60,000) with tf_efficientnet_lite0 features from a feature cache.

  (a) bare FAISS exact top-100 search (normalise, IndexFlatIP, search)
  (b) featcache top-k metrics: search + mrr@100, recall@k, hit@k, precision@k, map@100
  (c) featcache full-ranking metrics: exact map and mrr over the whole gallery (+ all @k)
  (d) naive loop: per query ``G @ q`` then ``sklearn.metrics.average_precision_score``,
      timed on a sample of queries (default 500) and scaled to all queries

Targets: b <= 1.2 a, d / c >= 20. The naive sample's AP values are checked against (c).

Usage::

    python -m featcache.extract ...   # or featcache extract: lite0 features of fashion-mnist
    python benchmarks/retrieval.py --cache fmnist.zarr --backbone tf_efficientnet_lite0 \
        --dataset fashion-mnist [--n-query 2000 --n-gallery 12000] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time

import numpy as np


def _subsample(n_total: int, n: int | None, seed: int) -> np.ndarray:
    if n is None or n >= n_total:
        return np.arange(n_total)
    return np.sort(np.random.default_rng(seed).choice(n_total, n, replace=False))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="feature cache holding the dataset's query and gallery splits")
    p.add_argument("--backbone", default="tf_efficientnet_lite0")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--query", default="test")
    p.add_argument("--gallery", default="train")
    p.add_argument("--n-query", type=int, default=None, help="subsample queries (slow machines)")
    p.add_argument("--n-gallery", type=int, default=None, help="subsample the gallery (slow machines)")
    p.add_argument("--naive-sample", type=int, default=500, help="queries timed in the naive loop (d)")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--max-memory", default="2GB")
    p.add_argument("--backend", default="auto", help="featcache search backend (a uses faiss CPU/GPU)")
    p.add_argument("--repeat", type=int, default=1, help="time a and b this many times, keep the fastest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument(
        "--allow-partial", action="store_true", help="use the finished rows of a split still being extracted (reported)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import faiss
    from sklearn.metrics import average_precision_score

    from featcache.retrieval import SemanticRelevance, evaluate, prepare
    from featcache.store import open_cache

    cache = open_cache(args.cache)
    fq = cache.load(args.backbone, args.dataset, args.query, allow_partial=args.allow_partial)
    fg = cache.load(args.backbone, args.dataset, args.gallery, allow_partial=args.allow_partial)
    qi = _subsample(len(fq), args.n_query, args.seed)
    gi = _subsample(len(fg), args.n_gallery, args.seed + 1)
    qi, gi = qi[fq.valid[qi]], gi[fg.valid[gi]]
    Xq, yq, idq = fq.X[qi], fq.labels[qi], fq.ids[qi]
    Xg, yg, idg = fg.X[gi], fg.labels[gi], fg.ids[gi]
    nq, ng, d = Xq.shape[0], Xg.shape[0], Xq.shape[1]
    rel = SemanticRelevance(yq, yg, idq, idg)
    ks = sorted({1, 5, 10, args.k})
    print(
        f"{args.backbone} / {args.dataset}: {nq} queries ({args.query}) x {ng} gallery ({args.gallery}), dim {d}, "
        f"input {fq.provenance.get('data_config', {}).get('input_size', '?')}"
    )
    print(
        f"machine: {platform.processor() or platform.machine()}, faiss {faiss.__version__}, "
        f"faiss GPUs {faiss.get_num_gpus()}, omp threads {faiss.omp_get_max_threads()}"
    )

    def bare_faiss():
        Q, G = prepare(Xq, "cosine"), prepare(Xg, "cosine")
        index = faiss.IndexFlatIP(d)
        if faiss.get_num_gpus() > 0:
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        index.add(G)
        return index.search(Q, args.k)

    def timed(fn, repeat=1):
        best, out = float("inf"), None
        for _ in range(repeat):
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
        return best, out

    t_a, _ = timed(bare_faiss, args.repeat)
    t_b, res_b = timed(
        lambda: evaluate(
            Xq, Xg, rel, metric="cosine", ks=ks, full=False, backend=args.backend, max_memory=args.max_memory
        ),
        args.repeat,
    )
    t_c, res_c = timed(
        lambda: evaluate(
            Xq, Xg, rel, metric="cosine", ks=ks, full=True, backend=args.backend, max_memory=args.max_memory
        )
    )

    # the exact similarity GEMM alone, in the blocks (c) uses: the floor of any exact full ranking
    Q, G = prepare(Xq, "cosine"), prepare(Xg, "cosine")
    from featcache.retrieval.search import parse_memory, rows_per_block

    B = rows_per_block(ng, parse_memory(args.max_memory), 12)
    t = time.perf_counter()
    for s0 in range(0, nq, B):
        Q[s0 : s0 + B] @ G.T
    t_gemm = time.perf_counter() - t

    # (d) naive per-query loop on a sample, scaled up
    sample = _subsample(nq, args.naive_sample, args.seed + 2)
    t = time.perf_counter()
    naive_ap = []
    for q in sample:
        s = G @ Q[q]
        naive_ap.append(average_precision_score(yg == yq[q], s))
    t_d_sample = time.perf_counter() - t
    t_d = t_d_sample * nq / len(sample)
    ap_c = res_c["per_query"]["map"][sample]
    max_diff = float(np.nanmax(np.abs(np.asarray(naive_ap) - ap_c)))

    # agreement of the top-k path with the full ranking on every @k metric
    diff_bc = max(float(np.nanmax(np.abs(res_b["per_query"][m] - res_c["per_query"][m]))) for m in res_b["per_query"])
    fig = {
        "n_query": nq,
        "n_gallery": ng,
        "dim": d,
        "k": args.k,
        "a_bare_faiss_s": t_a,
        "b_topk_metrics_s": t_b,
        "c_full_ranking_s": t_c,
        "d_naive_sklearn_scaled_s": t_d,
        "d_sample_queries": len(sample),
        "d_sample_s": t_d_sample,
        "b_over_a": t_b / t_a,
        "d_over_c": t_d / t_c,
        "gemm_only_s": t_gemm,
        "d_over_gemm": t_d / t_gemm,
        "backend_b": res_b["backend"],
        "backend_c": res_c["backend"],
        "map": res_c["means"]["map"],
        "mrr": res_c["means"]["mrr"],
        f"map@{args.k}": res_c["means"][f"map@{args.k}"],
        "recall@5": res_c["means"]["recall@5"],
        "hit@5": res_c["means"]["hit@5"],
        "precision@5": res_c["means"]["precision@5"],
        "max_abs_diff_naive_vs_full_ap": max_diff,
        "max_abs_diff_topk_vs_full": diff_bc,
    }
    print()
    print("| step | seconds | |")
    print("|---|---:|---|")
    print(f"| (a) bare FAISS top-{args.k} | {t_a:.2f} | |")
    print(f"| (b) featcache top-k metrics | {t_b:.2f} | b/a = {t_b / t_a:.2f} (target <= 1.2) |")
    print(f"| (c) featcache full-ranking mAP | {t_c:.2f} | of which the exact GEMM alone: {t_gemm:.2f} |")
    print(
        f"| (d) naive sklearn loop, {len(sample)} queries scaled to {nq} | {t_d:.2f} | d/c = {t_d / t_c:.1f} "
        f"(target >= 20; ceiling d/GEMM = {t_d / t_gemm:.1f}) |"
    )
    print()
    print(
        f"map={fig['map']:.4f} mrr={fig['mrr']:.4f} map@{args.k}={fig[f'map@{args.k}']:.4f} "
        f"recall@5={fig['recall@5']:.4f} hit@5={fig['hit@5']:.4f} precision@5={fig['precision@5']:.4f}"
    )
    print(
        f"naive AP vs full-ranking AP on the sample: max |diff| = {max_diff:.2e}; "
        f"top-k vs full @k metrics: max |diff| = {diff_bc:.2e}"
    )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(fig, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
