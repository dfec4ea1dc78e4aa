"""``featcache retrieve``: retrieval metrics and k-NN accuracy from cached features."""

from __future__ import annotations

import argparse


def _ks(text: str) -> list[int]:
    try:
        ks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--k takes comma-separated integers like 1,5,10,100, got {text!r}") from exc
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k takes positive integers like 1,5,10,100, got {text!r}")
    return ks


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "retrieve",
        help="retrieval metrics (mAP, MRR, recall@k, hit@k) and k-NN accuracy from cached features",
        description=(
            "Rank the gallery for every query by feature similarity and score the rankings. "
            "Semantic retrieval (a match shares the query's label) unless --relevance gives "
            "explicit positives/junk. Ties are broken by gallery index; the query itself "
            "(same id) is never its own match."
        ),
    )
    p.add_argument("--cache", required=True, help="feature cache root (local dir or fsspec URL)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--backbone", action="append", help="backbone key in the store (repeatable)")
    who.add_argument("--all", action="store_true", help="every backbone that holds the dataset")
    p.add_argument("--dataset", required=True)
    p.add_argument("--query", required=True, help="query split, e.g. test")
    p.add_argument("--gallery", required=True, help="gallery split, or 'same' for leave-one-out within --query")
    p.add_argument("--metric", choices=("cosine", "ip", "l2"), default="cosine", help="similarity (default cosine)")
    p.add_argument("--k", type=_ks, default=[1, 5, 10, 100], help="cut-offs for @k metrics (default 1,5,10,100)")
    p.add_argument("--relevance", help="parquet/CSV with query_id, gallery_id, relevance in {positive, junk}")
    p.add_argument("--max-memory", default="2GB", help="memory bound for score blocks (default 2GB)")
    p.add_argument("--top-k-only", action="store_true",
                   help="skip the full ranking: only @k metrics (and mrr@K) from a top-K search")
    p.add_argument("--no-knn", action="store_true", help="skip k-NN classification (k=10,20,100,200, T=0.07)")
    p.add_argument("--backend", default="auto",
                   choices=("auto", "faiss-gpu", "torch-cuda", "faiss-cpu", "torch-cpu", "numpy"))
    p.add_argument("--kind", default="pooled", help="feature kind in the store (default pooled)")
    p.add_argument("--results", required=True, help="results parquet to append to (rows of a rerun are replaced)")
    p.set_defaults(func=run)


def run(args) -> int:
    from featcache.results import check_results_path
    from featcache.retrieval.run import run_retrieval

    check_results_path(args.results)  # a bad --results fails before any compute

    frame = run_retrieval(
        args.cache,
        None if args.all else args.backbone,
        args.dataset,
        args.query,
        args.gallery,
        metric=args.metric,
        ks=args.k,
        results_path=args.results,
        knn=not args.no_knn,
        relevance=args.relevance,
        full=not args.top_k_only,
        max_memory=args.max_memory,
        backend=args.backend,
        kind=args.kind,
    )
    shown = {"map", "mrr", "top1"} | {f"{m}@{k}" for m in ("map", "recall", "hit", "precision") for k in args.k}
    for (kind, backbone, protocol), g in frame.group_by(["kind", "backbone", "protocol"], maintain_order=True):
        vals = ", ".join(f"{m}={v:.4f}" for m, v in zip(g["metric"], g["value"]) if m in shown)
        print(f"{backbone}  {args.dataset}  {kind}:{protocol}  {vals}")
    print(f"{frame.height} rows -> {args.results}")
    return 0
