"""Benchmark: the 45-value C sweep, exhaustive vs halving, against one fit (issue 13 item 6).

For each regime: the exhaustive sweep (every C of featcache.core.protocols.C_GRID to the full
tolerance along the warm path, ``block=1``: its cheapest schedule), the halving sweep
(``sweep="halving"``: loose scan + climb, :mod:`featcache.probes._halving`) and one fit
(:class:`LogisticProbe` at the exhaustive sweep's C from a zero start, on the same train
rows). Reported per arm: head-iterations (one head, one L-BFGS iteration), head-passes
(one head, one loss/gradient evaluation over the training rows: iterations plus the
line-search re-evaluations and each fit's first evaluation; the GEMM work), seconds, and
the ratios to one fit; the selected C and its validation top-1 (halving's own, and the
exhaustive sweep's at halving's C, which is what "within 0.1 point" compares).

Regimes (synthetic rows: x = (mu[y] + z) diag(s) Q^T, z ~ N(0, I), mu ~ N(0, sep^2),
Q a fixed random rotation, s_i^2 = i^-alpha, i.e. a covariance spectrum with condition
number kappa = D^alpha; alpha = 0 is benchmarks/probe_scale.py's isotropic generator):

``imagenet``  30,000 x 256 x 100 classes, alpha 2 (kappa 6.6e4), sep 0.25: top-1 ~0.79 and
              one fit at the selected C needs hundreds of L-BFGS iterations, like an
              ImageNet linear probe (ill-conditioned features, weak selected regularisation).
``imagenet-mild``  20,000 x 256 x 100, alpha 1.66 (kappa 1e4), sep 0.3: top-1 ~0.88, one
              fit ~100 iterations, a flat validation curve above the best C.
``cheap``     10,000 x 256 x 100, alpha 0, sep 0.15 (the isotropic generator): one fit
              needs ~10 iterations, so any sweep's fixed per-C cost dominates.
``digits`` / ``fmnist``  real lite0 features from the test fixture cache
              ($FEATCACHE_TEST_CACHE; skipped when absent): small, ~40 iterations per fit.

    nice -n 10 python benchmarks/probe_sweep_halving.py --json benchmarks/results/probe_sweep_halving.json
    nice -n 10 python benchmarks/probe_sweep_halving.py --regimes imagenet,imagenet-mild --seeds 1,2 \
        --json benchmarks/results/probe_sweep_halving_seeds.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import numpy as np

REGIMES = {
    "imagenet": {"n": 30000, "dim": 256, "classes": 100, "sep": 0.25, "alpha": 2.0},
    "imagenet-mild": {"n": 20000, "dim": 256, "classes": 100, "sep": 0.3, "alpha": 1.66},
    "cheap": {"n": 10000, "dim": 256, "classes": 100, "sep": 0.15, "alpha": 0.0},
    "digits": {"real": "digits"},
    "fmnist": {"real": "fmnist"},
}


def synth(seed: int, n: int, dim: int, classes: int, sep: float, alpha: float):
    """Rows of the synthetic split (float16, as stored) and labels; see the module doc."""
    means = np.random.default_rng(seed).normal(0.0, sep, (classes, dim)).astype(np.float32)
    y = np.random.default_rng([seed, 1]).integers(0, classes, size=n)
    X = means[y] + np.random.default_rng([seed, 2]).standard_normal((n, dim), np.float32)
    if alpha > 0:
        Q, _ = np.linalg.qr(np.random.default_rng([seed, 3]).standard_normal((dim, dim)))
        s = np.arange(1, dim + 1) ** (-alpha / 2)
        X = X @ (Q * s).T.astype(np.float32)
    return X.astype(np.float16), y


def load(regime: dict, seed: int):
    """(X_train, y_train, X_val, y_val) of a regime; None when its fixture store is absent."""
    if "real" in regime:
        root = os.environ.get("FEATCACHE_TEST_CACHE")
        path = os.path.join(root or "", f"{regime['real']}.zarr")
        if not root or not os.path.exists(path):
            return None
        from featcache.store import open_cache

        c = open_cache(path)
        ds = "digits" if regime["real"] == "digits" else "fashion-mnist-small"
        tr = c.load("tf_efficientnet_lite0", ds, "train")
        X, y = tr.X.astype(np.float16), np.asarray(tr.labels)
        p = np.random.default_rng(seed).permutation(y.size)
        k = int(0.75 * y.size)
        return X[p[:k]], y[p[:k]], X[p[k:]], y[p[k:]]
    X, y = synth(seed, regime["n"], regime["dim"], regime["classes"], regime["sep"], regime["alpha"])
    nv = regime["n"] // 5
    return X[nv:], y[nv:], X[:nv], y[:nv]


@contextlib.contextmanager
def count_passes():
    """Count head-passes: heads x loss/gradient evaluations of the torch solver."""
    from featcache.probes import _solver

    box = {"passes": 0}
    orig = _solver._Problem.loss_grad

    def counted(self, theta, lam, need_grad=True):
        box["passes"] += int(theta.shape[0])
        return orig(self, theta, lam, need_grad)

    _solver._Problem.loss_grad = counted
    try:
        yield box
    finally:
        _solver._Problem.loss_grad = orig


def run_regime(name: str, regime: dict, seed: int, tight_tol: float = 1e-6) -> dict | None:
    from featcache.probes import DEFAULT_CS, LogisticProbe, sweep_C

    data = load(regime, seed)
    if data is None:
        return None
    Xt, yt, Xv, yv = data
    out = {"regime": name, "seed": seed, **regime, "train": len(yt), "val": len(yv), "dim": int(Xt.shape[1])}
    out["classes"] = int(np.unique(yt).size)
    sweeps = {}
    for mode in ("exhaustive", "halving"):
        kw = {"block": 1} if mode == "exhaustive" else {}
        with count_passes() as box:
            t0 = time.perf_counter()
            sw = sweep_C(Xt, yt, Xv, yv, DEFAULT_CS, backend="torch", sweep=mode, **kw)
            sec = time.perf_counter() - t0
        sweeps[mode] = sw
        out[mode] = {
            "seconds": sec,
            "head_iters": sw.info["head_iters"],
            "head_passes": box["passes"],
            "best_C": sw.best_C,
            "best_index": sw.best_index,
            "val_top1": sw.val_top1[sw.best_index],
            "fitted": int(sum(h is not None for h in sw.heads)),
        }
        if mode == "halving":
            out[mode]["rounds"] = sw.info["round_log"]
        else:
            out[mode]["n_iter"] = sw.n_iter
            out[mode]["val_all"] = sw.val_top1
    ex, hv = sweeps["exhaustive"], sweeps["halving"]
    out["halving"]["exhaustive_val_at_its_C"] = ex.val_top1[hv.best_index]
    out["halving"]["points_below_exhaustive"] = 100 * (ex.val_top1[ex.best_index] - ex.val_top1[hv.best_index])
    with count_passes() as box:
        t0 = time.perf_counter()
        p = LogisticProbe(C=ex.best_C, backend="torch").fit(Xt, yt)
        sec = time.perf_counter() - t0
    out["one_fit"] = {"seconds": sec, "n_iter": int(p.n_iter_), "head_passes": box["passes"], "C": ex.best_C}
    one = out["one_fit"]
    # the reference's own val top-1 carries the sweep tolerance's noise (a warm-started C
    # whose start already met tol keeps its neighbour's head): refit both selected C
    # from zero to a 100x tighter tolerance and compare those
    out["tight"] = {"tol": tight_tol}
    for mode, sw in sweeps.items():
        if mode == "halving" and sw.best_C == ex.best_C:
            out["tight"][mode] = out["tight"]["exhaustive"]
            continue
        q = LogisticProbe(C=sw.best_C, backend="torch", tol=tight_tol, max_iter=5000).fit(Xt, yt)
        out["tight"][mode] = float(np.mean(q.predict(np.asarray(Xv, np.float32)) == yv))
    out["tight"]["points_below"] = 100 * (out["tight"]["exhaustive"] - out["tight"]["halving"])
    for mode in ("exhaustive", "halving"):
        r = out[mode]
        r["x_one_fit_iters"] = r["head_iters"] / one["n_iter"]
        r["x_one_fit_passes"] = r["head_passes"] / one["head_passes"]
        r["x_one_fit_seconds"] = r["seconds"] / one["seconds"]
    return out


def report(r: dict) -> str:
    one, ex, hv = r["one_fit"], r["exhaustive"], r["halving"]
    lines = [
        f"{r['regime']} (seed {r['seed']}): {r['train']} train / {r['val']} val x {r['dim']} x {r['classes']} classes",
        f"  one fit     C={one['C']:.3g}: {one['n_iter']:5d} iter  {one['head_passes']:5d} passes  "
        f"{one['seconds']:7.1f} s",
    ]
    for mode, a in (("exhaustive", ex), ("halving", hv)):
        lines.append(
            f"  {mode:10s}  C={a['best_C']:.3g}: {a['head_iters']:5d} iter  {a['head_passes']:5d} passes  "
            f"{a['seconds']:7.1f} s  = {a['x_one_fit_iters']:.2f}x / {a['x_one_fit_passes']:.2f}x / "
            f"{a['x_one_fit_seconds']:.2f}x one fit (iter / passes / s); val top-1 {a['val_top1']:.4f}; "
            f"{a['fitted']} C fitted"
        )
    t = r["tight"]
    lines.append(
        f"  refit at tol {t['tol']:g}: val top-1 {t['exhaustive']:.4f} at exhaustive's C, {t['halving']:.4f} "
        f"at halving's ({t['points_below']:+.2f} points below)"
    )
    lines.append(
        f"  halving / exhaustive: {hv['head_iters'] / ex['head_iters']:.2f}x iter, "
        f"{hv['seconds'] / ex['seconds']:.2f}x s; exhaustive val at halving's C {hv['exhaustive_val_at_its_C']:.4f} "
        f"({hv['points_below_exhaustive']:+.2f} points below its best)"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--regimes", default="imagenet,imagenet-mild,cheap,digits,fmnist", help=f"comma list of {list(REGIMES)}"
    )
    ap.add_argument("--seeds", default="0", help="comma list of data seeds (synthetic rows, real splits)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import torch

    results = []
    for seed in [int(v) for v in a.seeds.split(",")]:
        for name in a.regimes.split(","):
            r = run_regime(name, REGIMES[name], seed)
            if r is None:
                print(f"{name}: skipped (no fixture store under $FEATCACHE_TEST_CACHE)", flush=True)
                continue
            results.append(r)
            print(report(r), flush=True)
    if a.json:
        meta = {
            "threads": torch.get_num_threads(),
            "probe_threads": os.environ.get("FEATCACHE_PROBE_THREADS", "default (half the cores)"),
            "cpus": os.cpu_count(),
        }
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "regimes": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
