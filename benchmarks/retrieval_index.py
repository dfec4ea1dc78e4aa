"""Benchmark: approximate FAISS indexes against exact search in ``featcache retrieve``.

A synthetic store (``probe_scale.py``'s generator, as ``retrieval_scale.py``: ``--rows``
gallery rows x ``--dim`` float16, ``--classes`` classes, ``--queries`` queries; the issue's
full scale is ImageNet's 1,281,167 x 2048), then in a fresh process each (its own peak
resident set, Linux ``VmHWM``):

- ``exact``: ``run_retrieval(..., full=False)``, the baseline: exact top-k, @k metrics;
- one arm per factory (``--factories``; ``{nlist}`` is replaced by ``--nlist``): the same run
  with ``index=FACTORY`` (trained on a seeded gallery sample, built, stored, searched),
  reporting ``index_recall@10`` (its top-10 vs exact on ``--recall-queries`` queries) and
  ``delta_map@10`` (approximate - exact mAP@10 on those labelled queries).

Time, peak RSS, index bytes, recall@10 and mAP@10 delta per arm; writes JSON.

    python benchmarks/retrieval_index.py --rows 100000 --json benchmarks/results/retrieval_index.json
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
DEFAULT_FACTORIES = "IVF{nlist},Flat;IVF{nlist},PQ64;HNSW32;OPQ64,IVF{nlist},PQ64"


def arm(store: str, factory: str, nprobe: int | None, recall_queries: int) -> dict:
    import torch  # noqa: F401  (imported before the clock, as in every arm)
    from probe_scale import _vm_hwm  # this script's folder is on sys.path

    from featcache.retrieval import RetrievalConfig, run_retrieval

    if factory == "baseline":
        return {"arm": factory, "vm_hwm_bytes": _vm_hwm()}
    res = tempfile.mkdtemp(prefix="retrieval-index-")
    kw = {} if factory == "exact" else {"index": factory, "recall_queries": recall_queries}
    if nprobe and "IVF" in factory:
        kw["nprobe"] = nprobe
    if "HNSW" in factory:
        kw["ef_search"] = 64
    cfg = RetrievalConfig(
        store,
        "synth",
        ("synth",),
        query_split="test",
        gallery_split="train",
        ks=(1, 10),
        full=False,
        knn=False,
        progress=False,
        results_path=os.path.join(res, "r.parquet"),
        index_dir=os.path.join(res, "indexes"),
        **kw,
    )
    t0 = time.perf_counter()
    out = run_retrieval(cfg)
    seconds = time.perf_counter() - t0
    vals = dict(zip(out["metric"].to_list(), out["value"].to_list()))
    hp = out["hparams"][0]
    hp = json.loads(hp) if isinstance(hp, str) else hp
    shutil.rmtree(res, ignore_errors=True)
    return {
        "arm": factory,
        "seconds": seconds,
        "vm_hwm_bytes": _vm_hwm(),
        "map@10": vals["map@10"],
        "recall@10": vals.get("index_recall@10", 1.0),
        "delta_map@10": vals.get("delta_map@10", 0.0),
        "index": hp.get("index"),
    }


def run_arm(store: str, factory: str, nprobe: int | None, recall_queries: int) -> dict:
    cmd = [sys.executable, __file__, "--arm", factory, "--store", store, "--recall-queries", str(recall_queries)]
    cmd += ["--nprobe", str(nprobe)] if nprobe else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _print(r: dict, base: dict) -> None:
    ib = (r.get("index") or {}).get("bytes") or 0
    print(
        f"{r['arm']:22s} {r['seconds']:7.1f} s  peak RSS {r['vm_hwm_bytes'] / 1e9:5.2f} GB "
        f"(above imports {(r['vm_hwm_bytes'] - base['vm_hwm_bytes']) / 1e9:5.2f} GB)  index {ib / 1e9:5.2f} GB  "
        f"recall@10 {r['recall@10']:.4f}  mAP@10 {r['map@10']:.4f} (delta {r['delta_map@10']:+.4f})",
        flush=True,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_281_167, help="gallery rows (full scale: ImageNet's 1,281,167)")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--nlist", type=int, default=4096, help="IVF lists of the {nlist} factories")
    ap.add_argument("--nprobe", type=int, default=None, help="IVF nprobe (default FAISS's 1)")
    ap.add_argument("--recall-queries", type=int, default=1000, help="queries searched exactly for recall/deltas")
    ap.add_argument("--factories", default=DEFAULT_FACTORIES, help="';'-separated factory strings")
    ap.add_argument("--store", default=None, help="measure this existing synthetic store (train = gallery)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    if a.arm:
        print(json.dumps(arm(a.store, a.arm, a.nprobe, a.recall_queries)))
        return 0
    from probe_scale import write_store

    tmp = tempfile.TemporaryDirectory(prefix="featcache-retrieval-index-")
    base = run_arm(os.path.join(tmp.name, "none"), "baseline", None, a.recall_queries)
    store = a.store or os.path.join(tmp.name, "synth.zarr")
    if not a.store:
        write_store(store, a.rows, a.dim, a.classes, 0, 0.15)
        write_store(store, a.queries, a.dim, a.classes, 0, 0.15, split="test", offset=a.rows)
    print(f"gallery {store}: {a.rows} x {a.dim} float16, {a.queries} queries", flush=True)
    runs = [base]
    for factory in ["exact", *(f.format(nlist=a.nlist) for f in a.factories.split(";") if f)]:
        r = run_arm(store, factory, a.nprobe, a.recall_queries)
        r.update(rows=a.rows, dim=a.dim, queries=a.queries, nlist=a.nlist)
        r["uptime"] = _uptime()  # the load beside every figure
        runs.append(r)
        _print(r, base)
        if a.json:  # after every arm: a long run keeps what it measured
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json, "w") as fh:
                json.dump({"runs": runs}, fh, indent=1)
    tmp.cleanup()
    return 0


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
