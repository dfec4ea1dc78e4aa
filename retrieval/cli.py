"""``featcache retrieve``: retrieval metrics and k-NN accuracy from cached features."""

from __future__ import annotations

from dataclasses import replace

from featcache.core.tracking import add_track_argument
from featcache.retrieval.config import RetrievalConfig

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 60

#: ``featcache verify`` checks the stored retrieval indexes beside a store too (the store knows
#: no stage: featcache.cli reads this literal and registers it, imported when verify runs it)
BESIDE_STORE = {"retrieval indexes": "featcache.retrieval.index:verify_index_records"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "retrieve",
        help="retrieval metrics (mAP, MRR, recall@k, hit@k) and k-NN accuracy from cached features",
        description=(
            "Rank the gallery for every query by feature similarity and score the rankings. "
            "Semantic retrieval (a match shares the query's label) unless --relevance gives "
            "explicit positives/junk (or revisitop's easy/hard/junk: revisited Oxford/Paris, "
            "scored per --revisited setup, with revisitop's trapezoidal AP as map_revisitop). "
            "Battle of the Backbones' definitions are written beside featcache's: map_bob "
            "(revisitop's trapezoidal AP), mp@k (revisitop's mP@k), mrr_bob (before junk removal). "
            "Exactly tied similarities: featcache's metrics rank a tie group as a block at its "
            "last position (sklearn's AP convention, independent of the gallery order); BoB's "
            "rank ties in gallery order, as its stable argsort does. Within one split the query "
            "itself (same id) is never its own match."
        ),
    )
    RetrievalConfig.add_arguments(p)
    add_track_argument(p)
    p.set_defaults(func=run)
    t = subparsers.add_parser(
        "retrieve-text",
        help="image->text and text->image recall@k (CLIP_benchmark's zeroshot_retrieval) from stored "
        "image features and caption embeddings",
    )
    t.add_argument("--cache", required=True, help="feature cache with the images' features and caption embeddings")
    t.add_argument("--backbone", required=True, help="backbone key in the store")
    t.add_argument("--dataset", required=True, help="dataset key in the store")
    t.add_argument("--split", default="test", help="split of the captioned images (default test)")
    t.add_argument("--recall-k", default="1,5,10", help="comma-separated k values (default 1,5,10)")
    t.add_argument("--results", default=None, help="results table (parquet) the rows are appended to")
    t.add_argument("--force", action="store_true", help="re-run runs already in the results table")
    add_track_argument(t)
    t.set_defaults(func=run_text)


def run_text(args) -> int:
    from featcache.core.results import check_results_path
    from featcache.core.tracking import open_tracking
    from featcache.errors import ConfigError
    from featcache.retrieval.text import run_text_retrieval

    if args.results:
        check_results_path(args.results)
    try:
        ks = [int(k) for k in args.recall_k.split(",") if k.strip()]
    except ValueError:
        raise ConfigError(f"--recall-k {args.recall_k!r}: give comma-separated integers, e.g. 1,5,10") from None
    tracking = open_tracking(args.track, args.results)
    frame = run_text_retrieval(args.cache, args.backbone, args.dataset, args.split, ks, args.results, args.force)
    if tracking is not None:
        config = {
            k: getattr(args, k) for k in ("cache", "backbone", "dataset", "split", "recall_k", "results", "force")
        }
        tracking.log_rows("retrieve-text", frame, config)
    vals = ", ".join(f"{m}={v:.4f}" for m, v in zip(frame["metric"], frame["value"]))
    print(f"{args.backbone}  {args.dataset}/{args.split}  image-text  {vals}")
    return 0


#: what a run prints beside the registered retrieval metrics (each in its full and @k forms): the
#: kNN top-1 and the index-effect figures, which come from their own modules
_SHOWN_FULL = ("top1",)
_SHOWN_AT_K = ("index_recall", "delta_map", "absdelta_map")


def _shown(metric: str, ks) -> bool:
    """Whether ``featcache retrieve`` prints ``metric``: a registered retrieval metric (full, or
    at one of ``ks`` where it has an @k form), or one of the figures above."""
    from featcache.retrieval.metrics import RETRIEVAL_METRICS

    name, at, k = metric.partition("@")
    reg = RETRIEVAL_METRICS.get(name)
    if not at:
        return name in _SHOWN_FULL or (reg is not None and reg.full)
    return k.isdigit() and int(k) in ks and (name in _SHOWN_AT_K or (reg is not None and reg.at_k))


def run(args) -> int:
    from featcache.core.results import check_results_path
    from featcache.core.tracking import open_tracking
    from featcache.retrieval.run import run_retrieval

    cfg = RetrievalConfig.from_args(args)
    check_results_path(cfg.results_path)  # a bad --results fails before any compute
    tracking = open_tracking(args.track, cfg.results_path)
    if getattr(args, "no_progress", False):  # -q
        cfg = replace(cfg, progress=False)
    frame = run_retrieval(cfg)
    if tracking is not None:  # after the rows are written: a tracker never costs a result
        tracking.log_rows("retrieve", frame, cfg)
    for (kind, backbone, protocol), g in frame.group_by(["kind", "backbone", "protocol"], maintain_order=True):
        vals = ", ".join(f"{m}={v:.4f}" for m, v in zip(g["metric"], g["value"]) if _shown(m, cfg.ks))
        print(f"{backbone}  {cfg.dataset}  {kind}:{protocol}  {vals}")
    print(f"{frame.height} rows -> {cfg.results_path}")
    return 0
