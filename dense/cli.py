"""``featcache dense``: a dense protocol (segmentation, depth, Hummingbird) from the stored
patch-token grids and targets. Imports only argparse at module level."""

from __future__ import annotations

#: where this stage's commands stand in ``featcache --help`` (featcache.cli reads the literal)
HELP_ORDER = 45


def register(subparsers) -> None:
    from featcache.dense.config import DenseConfig

    p = subparsers.add_parser(
        "dense",
        help="dense protocols from stored token grids: seg-linear (mIoU), depth-linear (RMSE), hummingbird",
        description=(
            "Train and score a dense head on the patch-token grids and the masks / depth maps stored "
            "beside them (featcache extract on a dense dataset: ade20k:, voc:, cityscapes:, nyuv2:, "
            "segfolder:). Selects on the val split and reports test when both are stored, else selects "
            "on a seeded 10%% of the training images (their views left out) and reports val. One results "
            "row per metric (kind dense), beside every other stage's rows."
        ),
    )
    DenseConfig.add_arguments(p)
    from featcache.core.tracking import add_track_argument

    add_track_argument(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import replace

    from featcache.core.tracking import open_tracking
    from featcache.dense.config import DenseConfig
    from featcache.dense.runner import run_dense

    cfg = DenseConfig.from_args(args)
    tracking = open_tracking(args.track, cfg.results_path)
    if getattr(args, "no_progress", False):
        cfg = replace(cfg, progress=False)
    frame = run_dense(cfg)
    if tracking is not None:  # after the rows are written: a tracker never costs a result
        tracking.log_rows("dense", frame, cfg)
    for r in frame.iter_rows(named=True):
        print(
            f"{r['backbone']}  {r['protocol']}  {cfg.dataset}/{r['eval_split']}  seed {r['seed']}  "
            f"{r['metric']}={r['value']:.4f}"
        )
    print(f"{frame.height} rows" + (f" -> {cfg.results_path}" if cfg.results_path else ""))
    return 0
