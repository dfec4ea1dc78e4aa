"""Benchmark: how retrieval's time and peak memory grow with the gallery size N.

For each N (default 50k, 100k, 200k gallery rows x 2048 float16, 100 classes, 2,000 queries;
the synthetic generator of ``probe_scale.py``, written through featcache's writer), in a fresh
process each (its own peak resident set, Linux ``VmHWM``):

- ``store``: ``run_retrieval`` on the store, the user's path (full ranking: mAP, MRR,
  Recall/precision@k; no k-NN, so both arms compute the same metrics). Features load in
  the stored dtype; a gallery whose float32 copy exceeds a quarter of ``--max-memory`` is
  streamed (``PreparedRows``: float32 blocks made as they are scored), a smaller one is
  prepared once and held.
- ``float32``: the reference, the path before streaming: the splits read as float32,
  ``prepare`` makes the whole normalised float32 copy, ``full_ranking_metrics`` scores it
  (same metrics, same score-block bound).

Prints time and peak RSS per arm and N, the peak relative to the gallery's float16 size and
above the imports-only baseline, and the store/float32 ratios; writes JSON.

    python benchmarks/retrieval_scale.py --json benchmarks/results/retrieval_scale.json

``--store PATH`` measures an existing synthetic store instead (``probe_scale.py``'s: splits
``train`` = gallery, ``test`` = queries), e.g. ImageNet's 1.28M x 2048 with ``--arms store``
(the float32 arm would need ~21 GB there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def arm(store: str, which: str, max_memory: str) -> dict:
    import numpy as np
    import torch  # noqa: F401  (imported before the clock, as in every arm)
    from probe_scale import _vm_hwm  # this script's folder is on sys.path

    from featcache.retrieval import RetrievalConfig, run_retrieval

    if which == "baseline":
        return {"arm": which, "vm_hwm_bytes": _vm_hwm()}
    t0 = time.perf_counter()
    if which == "store":
        res = tempfile.mkdtemp(prefix="retrieval-scale-")
        cfg = RetrievalConfig(
            store,
            "synth",
            ("synth",),
            query_split="test",
            gallery_split="train",
            results_path=os.path.join(res, "r.parquet"),
            progress=False,
            max_memory=max_memory,
            knn=False,
        )
        out = run_retrieval(cfg)
        vals = {"map": float(out.filter(out["metric"] == "map")["value"][0])}
        shutil.rmtree(res, ignore_errors=True)
    else:
        from featcache.retrieval import DEFAULT_KS, SemanticRelevance, full_ranking_metrics, prepare, summarize
        from featcache.retrieval.search import parse_memory
        from featcache.store import open_cache

        c = open_cache(store)
        q, g = c.load("synth", "synth", "test"), c.load("synth", "synth", "train")
        rel = SemanticRelevance(q.labels, g.labels, np.asarray(q.ids).astype(str), np.asarray(g.ids).astype(str))
        Q, G = prepare(q.X, "cosine"), prepare(g.X, "cosine")
        per_query = full_ranking_metrics(
            Q, G, rel, "cosine", DEFAULT_KS, max_memory=parse_memory(max_memory), progress=False
        )
        vals = {"map": float(summarize(per_query, rel.n_relevant())[0]["map"])}
    return {"arm": which, "seconds": time.perf_counter() - t0, "vm_hwm_bytes": _vm_hwm(), **vals}


def run_arm(store: str, which: str, max_memory: str) -> dict:
    cmd = [sys.executable, __file__, "--arm", which, "--store", store, "--max-memory", max_memory]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _shape(store: str, split: str) -> tuple[int, int]:
    import zarr

    return tuple(zarr.open_group(store, mode="r")[f"features/synth/synth/{split}/pooled"].shape)


def _classes(store: str) -> int:
    import numpy as np
    import zarr

    return int(np.unique(zarr.open_group(store, mode="r")["datasets/synth/train/labels"][:]).size)


def _sizes(a) -> list[int]:
    return [_shape(a.store, "train")[0]] if a.store else [int(s) for s in a.sizes.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="50000,100000,200000", help="gallery rows")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--max-memory", default="512MB", help="score-block bound of the search")
    ap.add_argument("--arms", default="store,float32")
    ap.add_argument("--store", default=None, help="measure this existing store (train = gallery, test = queries)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm:
        print(json.dumps(arm(a.store, a.arm, a.max_memory)))
        return 0
    sys.path.insert(0, HERE)
    from probe_scale import write_store

    tmp = tempfile.TemporaryDirectory(prefix="featcache-retrieval-scale-")
    base = run_arm(os.path.join(tmp.name, "none"), "baseline", a.max_memory)
    print(f"baseline (python + torch + featcache imported): peak RSS {base['vm_hwm_bytes'] / 1e9:.2f} GB", flush=True)
    runs = [base]
    for n in _sizes(a):
        store = a.store or os.path.join(tmp.name, f"synth{n}.zarr")
        if not a.store:
            write_store(store, n, a.dim, a.classes, 0, 0.15)
            write_store(store, a.queries, a.dim, a.classes, 0, 0.15, split="test", offset=n)
        dim, queries = _shape(store, "train")[1], _shape(store, "test")[0]
        classes = _classes(store)
        f16 = n * dim * 2
        by = {}
        for which in a.arms.split(","):
            r = run_arm(store, which, a.max_memory)
            r.update(n=n, dim=dim, queries=queries, classes=classes, gallery_f16_bytes=f16)
            runs.append(r)
            by[which] = r
            above = r["vm_hwm_bytes"] - base["vm_hwm_bytes"]
            print(
                f"N={n:>6} {which:8s} {r['seconds']:6.1f} s  peak RSS {r['vm_hwm_bytes'] / 1e9:5.2f} GB "
                f"({r['vm_hwm_bytes'] / f16:4.2f}x the float16 gallery; above the baseline "
                f"{above / 1e9:.2f} GB = {above / f16:.2f}x)  mAP {r['map']:.4f}",
                flush=True,
            )
        if {"store", "float32"} <= set(by):
            s, f = by["store"], by["float32"]
            print(
                f"N={n:>6} store/float32: time {s['seconds'] / f['seconds']:.2f}x, peak RSS "
                f"{s['vm_hwm_bytes'] / f['vm_hwm_bytes']:.2f}x, mAP equal: {s['map'] == f['map']}",
                flush=True,
            )
        if not a.store:
            shutil.rmtree(store, ignore_errors=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"runs": runs, "max_memory": a.max_memory}, fh, indent=1)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
