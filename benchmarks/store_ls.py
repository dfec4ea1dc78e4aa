"""Benchmark: `featcache ls` (``FeatureCache.catalog()``) with and without the group summary.

Writes the synthetic store of ``probe_scale.py`` (default 200k rows x 2048 float16, chunks of
1024 rows as ``featcache extract`` writes them) through featcache's writer, then times, in one
process and interleaved, ``catalog()`` answering from the writer's summary (after) and the
same call with the summary removed, so it reads every marked chunk as before (the same code
path ``ls`` took before summaries existed). Prints best-of-N wall times, their ratio and
this process's peak RSS; writes JSON with the load (``uptime``).

    python benchmarks/store_ls.py --json benchmarks/results/store_ls_200k.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))


def _time_ls(path: str) -> tuple[float, bool]:
    from featcache.store import open_cache

    t = time.perf_counter()
    cat = open_cache(path).catalog()
    return time.perf_counter() - t, bool(cat["complete"].all())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--chunk-rows", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import zarr
    from probe_scale import write_store

    from featcache.store.summary import SUMMARY_KEY

    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "synth.zarr")
        t = time.perf_counter()
        write_store(path, a.n, a.dim, 100, 0, 0.15, chunk_rows=a.chunk_rows)
        print(f"wrote {a.n} x {a.dim} float16 in {time.perf_counter() - t:.1f} s; load: {load}")
        g = zarr.open_group(path, mode="a")["features/synth/synth/train"]
        summary = dict(g.attrs[SUMMARY_KEY])
        after, before = [], []
        for _ in range(a.repeats):
            s, ok_after = _time_ls(path)
            after.append(s)
            del g.attrs[SUMMARY_KEY]
            s, ok_before = _time_ls(path)
            before.append(s)
            g.attrs[SUMMARY_KEY] = summary
            if not (ok_after and ok_before):
                raise SystemExit("catalog says incomplete: the benchmark store is broken")
    b, f = min(before), min(after)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"ls, every marked chunk read (before): {b:.3f} s   samples {[round(x, 3) for x in before]}")
    print(f"ls, writer's summary (after):         {f:.3f} s   samples {[round(x, 3) for x in after]}")
    print(f"after/before = {f / b:.4f} ({b / f:.0f}x faster); peak RSS {peak:.0f} MB")
    out = {
        "n": a.n,
        "dim": a.dim,
        "chunk_rows": a.chunk_rows,
        "before_s": before,
        "after_s": after,
        "ratio_after_before": f / b,
        "peak_rss_mb": peak,
        "uptime": load,
    }
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
