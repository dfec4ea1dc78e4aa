"""Benchmark: the probe on ImageNet-shaped float16 splits, in memory vs streamed (the C
sweep's cost is benchmarked by ``probe_sweep_halving.py``).

1. Writes a synthetic store through featcache's writer (fixed seed; class-dependent means,
   so the problem is learnable): split ``train`` of max(--sizes) x --dim float16 rows,
   --classes classes (default 200k x 2048 x 1000, 819 MB as float16), and a ``test`` split.
2. For each size N (the first N rows) and each arm, in a fresh subprocess (its own peak
   resident set, Linux ``VmHWM``; ``ru_maxrss`` is recorded too): ``memory`` = today's path (the split read as float32, in-memory solver,
   max_host_bytes=inf); ``streamed`` (max_host_bytes=0) = the split kept as float16 in memory, solver
   streaming row blocks; ``zarr`` = the store's zarr array handed to the probe, chunks read
   on every pass (nothing held whole). Each fits one C for --max-iter L-BFGS iterations (peak memory is reached in the
   first loss/gradient pass; time per iteration is reported). ``runner`` (largest size only) =
   ``featcache probe``'s own path, ``run_probes`` with protocol ``full`` and one C at the default
   memory bound: the split is loaded lazily (``load(..., lazy=True)``), a 10 % holdout selects,
   the refit streams all rows, and a --test-rows ``test`` split is evaluated.
Prints ratios against the reference measured in the same run and writes JSON.

    python benchmarks/probe_scale.py --sizes 25000,50000,200000 --json benchmarks/results/probe_scale.json
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


def synth_labels(seed: int, s: int, e: int, classes: int) -> np.ndarray:
    return np.random.default_rng([seed, 1]).integers(0, classes, size=e)[s:]


def synth_rows(seed: int, s: int, e: int, dim: int, classes: int, sep: float):
    """Rows s..e of the synthetic data: labels uniform at random, x = mu[y] + N(0, 1)."""
    means = np.random.default_rng(seed).normal(0.0, sep, (classes, dim)).astype(np.float32)
    y = synth_labels(seed, s, e, classes)
    noise = np.random.default_rng([seed, 2, s]).standard_normal((e - s, dim), np.float32)
    return (means[y] + noise).astype(np.float16), y


def stored_rows(
    seed: int, offset: int, n: int, dim: int, classes: int, sep: float, chunk_rows: int = 8192
) -> tuple[np.ndarray, np.ndarray]:
    """The ``n`` rows ``write_store(..., offset=offset)`` stores, drawn as it draws them: one
    ``synth_rows`` call per ``chunk_rows`` chunk (the noise is seeded by the chunk's first row)."""
    X, y = np.empty((n, dim), np.float16), np.empty(n, np.int64)
    for s in range(0, n, chunk_rows):
        e = min(s + chunk_rows, n)
        X[s:e], y[s:e] = synth_rows(seed, offset + s, offset + e, dim, classes, sep)
    return X, y


def write_store(
    path: str,
    n: int,
    dim: int,
    classes: int,
    seed: int,
    sep: float,
    split: str = "train",
    chunk_rows: int = 8192,
    offset: int = 0,
) -> None:
    """Split ``split`` of the synthetic store: generator rows ``offset .. offset + n``."""
    from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

    cache = open_cache(path, "a")
    y = synth_labels(seed, offset, offset + n, classes)
    ids = np.array([f"{split}-{i:07d}" for i in range(n)])
    meta = ensure_split(cache, "synth", split, ids, y, [f"c{k}" for k in range(classes)], "synthetic")
    prov = make_provenance(
        backbone="synth",
        dataset="synth",
        split=split,
        kind="pooled",
        dim=dim,
        n=n,
        dataset_fingerprint=meta.fingerprint,
        chunk_rows=chunk_rows,
        dtype="float16",
    )
    w = FeatureWriter(cache, "synth", "synth", split, {"pooled": prov}).prepare(overwrite=True)
    for i in w.pending_chunks():
        s, e = w.chunk_range(i)
        X, _ = synth_rows(seed, offset + s, offset + e, dim, classes, sep)
        w.write_chunk(i, {"pooled": X}, np.ones(e - s, bool))
    w.mark_complete()


def arm_fit(store: str, n: int, arm: str, max_iter: int) -> dict:
    """One subprocess arm: read the first n rows, fit one C; time and own peak RSS."""
    import resource

    import torch  # noqa: F401  (imported before the clock starts)
    import zarr

    from featcache.probes import LogisticProbe

    if arm == "baseline":  # the interpreter with torch, zarr and featcache imported
        return {
            "arm": arm,
            "n": 0,
            "vm_hwm_bytes": _vm_hwm(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    if arm == "runner":
        return runner_fit(store, max_iter)
    t0 = time.perf_counter()
    g = zarr.open_group(store, mode="r")
    arr = g["features/synth/synth/train/pooled"]
    y = np.asarray(g["datasets/synth/train/labels"][:n])
    if arm == "memory":  # today: the split as float32 in host memory
        X = np.asarray(arr[:n], np.float32)
    elif arm == "streamed":  # the split held as float16, streamed in row blocks
        X = arr[:n]
    else:  # "zarr": chunks read from the store on every pass, nothing held whole
        X = arr if n == arr.shape[0] else _rows_view(arr, n)
    t_read = time.perf_counter() - t0
    big = 1 << 62 if arm == "memory" else 0  # force each path at every size
    p = LogisticProbe(C=1.0, backend="torch", max_iter=max_iter, tol=1e-6, max_host_bytes=big)
    t1 = time.perf_counter()
    p.fit(X, y)
    fit = time.perf_counter() - t1
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    top1 = float(np.mean(p.predict(np.asarray(X[:2000], np.float32)) == y[:2000]))
    if arm == "zarr" and X is not arr:  # the temporary n-row copy of the store array
        import shutil

        shutil.rmtree(X.store.root, ignore_errors=True)
    return {
        "vm_hwm_bytes": _vm_hwm(),
        "arm": arm,
        "n": n,
        "dim": int(X.shape[1]),
        "dtype": str(X.dtype),
        "read_s": t_read,
        "fit_s": fit,
        "n_iter": int(p.n_iter_),
        "s_per_iter": fit / max(1, p.n_iter_),
        "peak_rss_bytes": int(rss),
        "streamed": bool(p.streamed_),
        "train_top1": top1,
    }


def runner_fit(store: str, max_iter: int) -> dict:
    """``featcache probe``'s own path (:func:`run_probes`, protocol ``full``: a 10 % holdout
    of train for the selection, refit on all of train, evaluation on ``test``) with one C and
    the default memory bound: the train split stays in the store and streams."""
    import resource

    from featcache.probes import ProbeConfig, run_probes

    res = tempfile.mkdtemp(prefix="probe-scale-runner-")
    cfg = ProbeConfig(
        store,
        ("synth",),
        "synth",
        "full",
        results_path=os.path.join(res, "r.parquet"),
        Cs=(1.0,),
        max_iter=max_iter,
        tol=1e-6,
        backend="torch",
        progress=False,
    )
    t0 = time.perf_counter()
    out = run_probes(cfg)
    fit = time.perf_counter() - t0
    hp = json.loads(out["hparams"][0])
    import shutil

    shutil.rmtree(res, ignore_errors=True)
    n = int(hp["n_train_final"])
    return {
        "vm_hwm_bytes": _vm_hwm(),
        "arm": "runner",
        "n": n,
        "dtype": "float16",
        "read_s": 0.0,
        "fit_s": fit,
        "n_iter": int(hp["n_iter"]),
        "s_per_iter": fit / max(1, 2 * int(hp["n_iter"])),  # two fits: selection and refit
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "streamed": bool(hp.get("streamed")),
        "test_top1": float(out.filter(out["metric"] == "top1")["value"][0]),
    }


def _rows_view(arr, n: int):
    """The first n rows of a zarr array, still read lazily (a store of exactly n rows)."""
    import zarr

    out = zarr.open_array(
        tempfile.mkdtemp(prefix="probe-scale-"), mode="w", shape=(n, arr.shape[1]), chunks=arr.chunks, dtype=arr.dtype
    )
    for s in range(0, n, arr.chunks[0]):
        e = min(n, s + arr.chunks[0])
        out[s:e] = arr[s:e]
    return out


def _vm_hwm() -> int:
    """This process image's peak resident set (Linux VmHWM; exec resets it, unlike
    ``ru_maxrss``, which a child inherits from its parent at fork)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def run_arm(store: str, n: int, arm: str, max_iter: int) -> dict:
    cmd = [sys.executable, __file__, "--arm", arm, "--arm-n", str(n), "--store", store, "--max-iter", str(max_iter)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="25000,50000,200000")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--sep", type=float, default=0.15, help="std of the class means")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-iter", type=int, default=2)
    ap.add_argument(
        "--arms", default="memory,streamed,zarr,runner", help="runner: featcache probe's path, at the largest size only"
    )
    ap.add_argument("--test-rows", type=int, default=10000, help="rows of the synthetic test split")
    ap.add_argument("--store", default=None, help="synthetic store path (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reuse-store", action="store_true", help="keep an existing --store as is")
    ap.add_argument("--write-store", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-n", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.arm:
        print(json.dumps(arm_fit(a.store, a.arm_n, a.arm, a.max_iter)))
        return 0
    if a.write_store:
        write_store(a.store, max(sizes), a.dim, a.classes, a.seed, a.sep)
        write_store(a.store, a.test_rows, a.dim, a.classes, a.seed, a.sep, split="test", offset=max(sizes))
        return 0
    tmp = tempfile.TemporaryDirectory(prefix="featcache-probe-scale-")
    store = a.store or os.path.join(tmp.name, "synth.zarr")
    t0 = time.perf_counter()
    # every heavy step runs in a child, so no child inherits a large parent's peak RSS
    if not (a.reuse_store and os.path.exists(store)):
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--write-store",
                "--store",
                store,
                "--sizes",
                a.sizes,
                "--dim",
                str(a.dim),
                "--classes",
                str(a.classes),
                "--seed",
                str(a.seed),
                "--sep",
                str(a.sep),
                "--test-rows",
                str(a.test_rows),
            ],
            check=True,
        )
    print(
        f"{'reused' if a.reuse_store else 'wrote'} {max(sizes)} x {a.dim} float16 ({max(sizes) * a.dim * 2 / 1e6:.0f} MB), "
        f"{a.classes} classes in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    base = run_arm(store, 0, "baseline", a.max_iter)
    print(
        f"baseline (python + torch + zarr + featcache imported): peak RSS {base['vm_hwm_bytes'] / 1e9:.2f} GB",
        flush=True,
    )
    runs = [base]
    for n in sizes:
        by_arm = {}
        for arm in a.arms.split(","):
            if arm == "runner" and n != max(sizes):  # the runner probes the whole stored split
                continue
            r = run_arm(store, n, arm, a.max_iter)
            by_arm[arm] = r
            runs.append(r)
            f16 = n * a.dim * 2
            extra = r["vm_hwm_bytes"] - base["vm_hwm_bytes"]
            print(
                f"N={n:>7} {arm:9s} peak RSS {r['vm_hwm_bytes'] / 1e9:6.2f} GB "
                f"({r['vm_hwm_bytes'] / f16:4.2f}x the float16 split; above the baseline "
                f"{extra / 1e9:.2f} GB = {extra / f16:.2f}x; ru_maxrss "
                f"{r['peak_rss_bytes'] / 1e9:.2f} GB), fit {r['fit_s']:7.1f} s "
                f"({r['s_per_iter']:.1f} s/iter, {r['n_iter']} iter), read {r['read_s']:.1f} s",
                flush=True,
            )
        if {"memory", "streamed"} <= set(by_arm):
            m, s = by_arm["memory"], by_arm["streamed"]
            print(
                f"N={n:>7} streamed/memory: RSS {s['vm_hwm_bytes'] / m['vm_hwm_bytes']:.2f}x, "
                f"time/iter {s['s_per_iter'] / m['s_per_iter']:.2f}x",
                flush=True,
            )
    result = {
        "dim": a.dim,
        "classes": a.classes,
        "max_iter": a.max_iter,
        "runs": runs,
        "threads": os.environ.get("FEATCACHE_PROBE_THREADS", "default (half the cores)"),
    }
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
