"""``featcache similarity`` (CKA and RSA between backbones) and ``featcache audit``
(train/test near-duplicates). Imports only argparse at module level."""

from __future__ import annotations

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 70


def register(subparsers) -> None:
    from featcache.similarity.config import AuditConfig, SimilarityConfig

    p = subparsers.add_parser(
        "similarity",
        help="CKA (linear, debiased, RBF) and RSA between every pair of backbones on one split",
        description=(
            "Compare backbones' representations of the same images: rows are joined by sample id "
            "(a missing or duplicated id is an error). Linear and debiased CKA stream the rows "
            "(any N, memory bounded by --max-memory); RBF CKA uses every row when the Gram "
            "matrices fit, else google-research's minibatch estimator on a random sample; RSA "
            "compares RDMs of at most the rows that fit. One results row per pair and measure "
            "(kind similarity; the report draws them as heatmaps)."
        ),
    )
    SimilarityConfig.add_arguments(p)
    from featcache.core.tracking import add_track_argument

    add_track_argument(p)
    p.set_defaults(func=run)
    a = subparsers.add_parser(
        "audit",
        help="near-duplicates between test (and val) and training rows, and kNN top-1 without them",
        description=(
            "For each query row (--query splits), its nearest training rows by cosine of one "
            "backbone's features; every pair above --threshold (default: chosen from the "
            "nearest-neighbour similarity distribution, plotted beside --out), exact duplicates "
            "by image content hash where the images are reachable, and kNN top-1 recomputed "
            "with the flagged query rows left out."
        ),
    )
    AuditConfig.add_arguments(a)
    a.set_defaults(func=run_audit_cli)


def run(args) -> int:
    from dataclasses import replace

    from featcache.core.results import check_results_path
    from featcache.core.tracking import open_tracking
    from featcache.similarity.config import SimilarityConfig
    from featcache.similarity.runner import run_similarity

    cfg = SimilarityConfig.from_args(args)
    if cfg.results_path is not None:
        check_results_path(cfg.results_path)
    tracking = open_tracking(args.track, cfg.results_path)
    if getattr(args, "no_progress", False):
        cfg = replace(cfg, progress=False)
    frame = run_similarity(cfg)
    if tracking is not None:  # after the rows are written: a tracker never costs a result
        tracking.log_rows("similarity", frame, cfg)
    if cfg.layers is not None:
        for line in layer_grid_lines(frame):
            print(line)
        print(f"{frame.height} rows" + (f" -> {cfg.results_path}" if cfg.results_path else ""))
        return 0
    for r in frame.iter_rows(named=True):
        print(f"{r['backbone']}  {r['protocol']}  {cfg.dataset}/{cfg.split}  {r['metric']}={r['value']:.4f}")
    print(f"{frame.height} rows" + (f" -> {cfg.results_path}" if cfg.results_path else ""))
    line = estimates_line(frame, cfg.max_memory)
    if line:
        print(line)
    return 0


def layer_grid_lines(frame) -> list[str]:
    """Each layer CKA grid as text: a header (pair, measure, route), then one line per layer
    of the first backbone with its values against the second's layers."""
    import json

    grids: dict[tuple[str, str, str], dict[tuple[int, int], float]] = {}
    route: dict[tuple[str, str, str], str] = {}
    for r in frame.iter_rows(named=True):
        hp = r["hparams"] if isinstance(r["hparams"], dict) else json.loads(r["hparams"] or "{}")
        key = (hp["backbone_a"], hp["backbone_b"], r["metric"])
        grids.setdefault(key, {})[(hp["layer_a"], hp["layer_b"])] = r["value"]
        route[key] = hp.get("route", "")
    out = []
    for (a, b, m), g in grids.items():
        la, lb = sorted({i for i, _ in g}), sorted({j for _, j in g})
        out.append(f"{a} (rows) vs {b} (columns: layers {','.join(map(str, lb))})  {m}  [{route[(a, b, m)]}]")
        out += [f"  layer {i:>3}: " + " ".join(f"{g.get((i, j), float('nan')):.3f}" for j in lb) for i in la]
    return out


def estimates_line(frame, max_memory: str) -> str:
    """One line naming the measures whose rows are estimates (``estimate`` in their hparams),
    or "" when every value is exact."""
    import json

    notes: dict[str, str] = {}
    for r in frame.iter_rows(named=True):
        hp = r["hparams"] if isinstance(r["hparams"], dict) else json.loads(r["hparams"] or "{}")
        if hp.get("estimate"):
            notes.setdefault(r["metric"], hp["estimate"])
    if not notes:
        return ""
    what = "; ".join(f"{m}: {note}" for m, note in notes.items())
    return (
        f"note: estimates, not exact values, within --max-memory {max_memory} ({what}); each row records "
        "its estimator in its hparams (estimate); a larger --max-memory gives the exact values"
    )


def run_audit_cli(args) -> int:
    from dataclasses import replace

    from featcache.similarity.audit import run_audit
    from featcache.similarity.config import AuditConfig

    cfg = AuditConfig.from_args(args)
    if getattr(args, "no_progress", False):
        cfg = replace(cfg, progress=False)
    report = run_audit(cfg)
    print(report.summary())
    return 0
