"""Benchmark: ``featcache probe --protocol full`` against scikit-learn's (and, on a GPU,
cuML's) logistic regression at the C featcache selected, same features, same run.

Arms, in this order, each in a fresh process (its own peak RSS, Linux ``VmHWM``):

- ``featcache``: ``run_probes`` with ``protocol="full"`` (z-scored features, the C grid
  searched on a seeded 10 % holdout of train, the final model refit on all of train at the
  selected C, top-1 on test), from opening the store to the results table;
- ``sklearn``: the splits read as float32, ``StandardScaler`` fit on train,
  ``LogisticRegression(C=<featcache's C>, solver="lbfgs", max_iter, tol)`` fit on all of
  train, top-1 on test: the one fit a user who already knew C would run;
- ``cuml`` (only where cuML imports and a GPU is present): the same with
  ``cuml.linear_model.LogisticRegression``.

So featcache's time includes its whole C search, the references one fit each: the ratio
says what the search costs beside a single fit. Prints time, peak RSS and top-1 per arm and
the ratios.

    python benchmarks/probe_full.py --store fmnist64.zarr --dataset fashion-mnist
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _hwm() -> int:
    sys.path.insert(0, HERE)
    from probe_scale import _vm_hwm

    return _vm_hwm()


def arm_featcache(a) -> dict:
    from featcache.probes.config import ProbeConfig
    from featcache.probes.runner import run_probes

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ProbeConfig(
            a.store,
            (a.backbone,),
            a.dataset,
            protocol="full",
            results_path=os.path.join(tmp, "r.parquet"),
            max_iter=a.max_iter,
            tol=a.tol,
            progress=False,
        )
        out = run_probes(cfg)
    row = out.filter(out["metric"] == "top1").row(0, named=True)
    hp = row["hparams"] if isinstance(row["hparams"], dict) else json.loads(row["hparams"])
    return {"seconds": time.perf_counter() - t0, "top1": float(row["value"]), "C": float(hp["C"]), "hparams": hp}


def _features(a):
    import numpy as np

    from featcache.store import open_cache

    c = open_cache(a.store)
    tr, te = c.load(a.backbone, a.dataset, "train"), c.load(a.backbone, a.dataset, "test")
    ok_tr, ok_te = np.asarray(tr.valid, bool), np.asarray(te.valid, bool)
    return tr.X[ok_tr], np.asarray(tr.labels)[ok_tr], te.X[ok_te], np.asarray(te.labels)[ok_te]


def arm_reference(a) -> dict:
    import numpy as np

    t0 = time.perf_counter()
    Xtr, ytr, Xte, yte = _features(a)
    if a.arm == "cuml":
        import cupy as cp
        from cuml.linear_model import LogisticRegression
        from cuml.preprocessing import StandardScaler

        sc = StandardScaler().fit(cp.asarray(Xtr))
        clf = LogisticRegression(C=a.C, max_iter=a.max_iter, tol=a.tol).fit(sc.transform(cp.asarray(Xtr)), ytr)
        pred = cp.asnumpy(clf.predict(sc.transform(cp.asarray(Xte))))
    else:
        from sklearn.linear_model import LogisticRegression
        from sklearn.preprocessing import StandardScaler

        sc = StandardScaler().fit(Xtr)
        clf = LogisticRegression(C=a.C, solver="lbfgs", max_iter=a.max_iter, tol=a.tol).fit(sc.transform(Xtr), ytr)
        pred = clf.predict(sc.transform(Xte))
    return {"seconds": time.perf_counter() - t0, "top1": float(np.mean(pred == yte)), "C": a.C}


def run_arm(a, which: str, C: float | None = None) -> dict:
    cmd = [sys.executable, __file__, "--arm", which, "--store", a.store, "--backbone", a.backbone]
    cmd += ["--dataset", a.dataset, "--max-iter", str(a.max_iter), "--tol", str(a.tol)]
    cmd += ["--C", repr(C)] if C is not None else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cuml_available() -> bool:
    code = "import cuml, cupy; assert cupy.cuda.runtime.getDeviceCount() > 0"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True, help="store with train and test features")
    ap.add_argument("--backbone", default="tf_efficientnet_lite0")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--max-iter", type=int, default=1000)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--C", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm:
        res = arm_featcache(a) if a.arm == "featcache" else arm_reference(a)
        print(json.dumps({"arm": a.arm, **res, "vm_hwm_bytes": _hwm()}))
        return 0
    arms = {"featcache": run_arm(a, "featcache")}
    C = arms["featcache"]["C"]
    arms["sklearn"] = run_arm(a, "sklearn", C)
    if _cuml_available():
        arms["cuml"] = run_arm(a, "cuml", C)
    f = arms["featcache"]
    for name, r in arms.items():
        print(
            f"{name:9s} {r['seconds']:7.1f} s  peak RSS {r['vm_hwm_bytes'] / 1e9:5.2f} GB  top-1 {r['top1']:.4f}"
            f"  (C = {r['C']:.3g})",
            flush=True,
        )
    for name, r in arms.items():
        if name != "featcache":
            print(
                f"featcache (C search + final fit) / {name} (one fit at that C): time "
                f"{f['seconds'] / r['seconds']:.2f}x, top-1 {f['top1'] - r['top1']:+.4f}",
                flush=True,
            )
    print(os.popen("uptime").read().strip())
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"store": a.store, "arms": arms}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
