"""Benchmark: exact top-k on the CPU, float32 candidates rescored in float64 against the whole
float64 product (the path before), on the same gallery in one run.

Since exact scores are summed in float64 (so a score does not depend on its block), the
numpy top-k computed every score as a float64 GEMM over a float64 copy of each gallery
block. It now takes a float32 GEMM, keeps the rows within its error bound of the k-th score
and scores those in float64 (``featcache.retrieval.search._topk_rescored``). Both arms run
``_search_numpy``'s loop on a synthetic gallery (``probe_scale.py``'s generator, float16 as
stored, streamed as ``featcache retrieve`` streams it), each in a fresh process (own peak
RSS, Linux ``VmHWM``), and the lists must be equal (scores and items).

    python benchmarks/retrieval_topk.py --rows 200000 --json benchmarks/results/retrieval_topk.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def arm(name: str, a: argparse.Namespace, out: str) -> dict:
    from probe_scale import _vm_hwm, stored_rows

    from featcache.retrieval import search
    from featcache.retrieval.prepared import prepared_pair
    from featcache.retrieval.search import parse_memory

    G = stored_rows(0, 0, a.rows, a.dim, a.classes, 0.15)[0]
    Qx = stored_rows(0, a.rows, a.queries, a.dim, a.classes, 0.15)[0]
    mem = parse_memory(a.max_memory)
    Q, P = prepared_pair(Qx, G, "cosine", cache_bytes=mem // 4)
    base = _vm_hwm()
    if name == "float64":  # the path before: every score a float64 product
        t = time.perf_counter()
        B = search.rows_per_block(P.shape[0], mem, 12)
        parts = [search._topk_float64(Q.block(s, s + B), P, a.k, "cosine") for s in range(0, Q.shape[0], B)]
        sc, ix = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        o = np.lexsort((ix, -sc), axis=1)
        sc, ix = np.take_along_axis(sc, o, 1), np.take_along_axis(ix, o, 1)
    else:
        t = time.perf_counter()
        sc, ix = search._search_numpy(Q, P, a.k, "cosine", mem)
    seconds = time.perf_counter() - t
    np.savez(out, sc=sc, ix=ix)
    return {"arm": name, "seconds": seconds, "vm_hwm_bytes": _vm_hwm(), "before_search_bytes": base}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--k", type=int, default=11, help="search depth (retrieve's @10 lists search 11)")
    ap.add_argument("--max-memory", default="2GB")
    ap.add_argument("--json", default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    if a.arm:
        print(json.dumps(arm(a.arm, a, a.out)))
        return 0
    tmp = tempfile.mkdtemp(prefix="featcache-topk-")
    runs = []
    for name in ("float64", "rescored"):
        cmd = [sys.executable, __file__, "--arm", name, "--out", os.path.join(tmp, name + ".npz")]
        cmd += [f"--{k}={v}" for k, v in (("rows", a.rows), ("queries", a.queries), ("dim", a.dim))]
        cmd += [f"--classes={a.classes}", f"--k={a.k}", f"--max-memory={a.max_memory}"]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        r["uptime"] = os.popen("uptime").read().strip()
        runs.append(r)
        print(
            f"{name:9s} {r['seconds']:7.1f} s  peak RSS {r['vm_hwm_bytes'] / 1e9:5.2f} GB "
            f"(before the search {r['before_search_bytes'] / 1e9:5.2f} GB)  {r['uptime']}",
            flush=True,
        )
    ref, new = (np.load(os.path.join(tmp, n + ".npz")) for n in ("float64", "rescored"))
    same = bool(np.array_equal(ref["sc"], new["sc"]) and np.array_equal(ref["ix"], new["ix"]))
    out = {"rows": a.rows, "queries": a.queries, "dim": a.dim, "k": a.k, "max_memory": a.max_memory}
    out.update(runs=runs, lists_equal=same, speedup=runs[0]["seconds"] / runs[1]["seconds"])
    print(f"rescored / float64: {out['speedup']:.2f}x faster; lists equal (scores and items): {same}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
