"""Benchmark: streamed linear + debiased CKA (``featcache similarity``) against the in-memory
numpy formula, time and peak memory, on a synthetic store of two backbones.

The store (written by this script through featcache's writer, chunk by chunk) holds one split
of N rows for backbones ``a`` (x ~ N(0, 1), D dims, float16) and ``b`` (x @ W / sqrt(D) + N(0, 1),
D dims, float16): related representations, CKA well inside (0, 1). Each arm runs in a fresh
process (its own peak resident set, Linux ``VmHWM``):

- ``stream``: ``run_similarity`` with ``measures=cka_linear,cka_debiased`` and ``--max-memory``,
  the user's path: lazy stored views, float64 ``[D, D]`` cross-products per block.
- ``numpy``: the reference, google-research's ``feature_space_linear_cka`` as in the notebook
  (both splits loaded as float32, float64 copies, biased and debiased), only where it fits.

Prints seconds and peak RSS per arm, the stream/numpy ratios and the two arms' CKA values
(equal to ~1e-9 relative); writes JSON with --json.

    python benchmarks/similarity_scale.py --n 100000 --dim 2048
    python benchmarks/similarity_scale.py --n 1281167 --dim 2048 --arms stream  # ImageNet train size
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

import numpy as np

CHUNK = 8192


def _vm_hwm() -> int:
    """This process image's peak resident set (Linux VmHWM; exec resets it)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def _rows(which: str, s: int, e: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng([seed, 1, s]).standard_normal((e - s, dim), np.float32)
    if which == "a":
        return x.astype(np.float16)
    w = np.random.default_rng([seed, 2]).standard_normal((dim, dim), np.float32) / np.sqrt(dim)
    noise = np.random.default_rng([seed, 3, s]).standard_normal((e - s, dim), np.float32)
    return (x @ w + noise).astype(np.float16)


def write_store(path: str, n: int, dim: int, seed: int) -> None:
    from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

    cache = open_cache(path, "a")
    ids = np.array([f"row-{i:07d}" for i in range(n)])
    meta = ensure_split(cache, "synth", "test", ids, np.zeros(n, np.int64), ["c0"], "synthetic")
    for b in ("a", "b"):
        prov = make_provenance(
            backbone=b, dataset="synth", split="test", kind="pooled", dim=dim, n=n,
            dataset_fingerprint=meta.fingerprint, chunk_rows=CHUNK, dtype="float16",
        )  # fmt: skip
        w = FeatureWriter(cache, b, "synth", "test", {"pooled": prov}).prepare(overwrite=True)
        todo, t0 = w.pending_chunks(), time.perf_counter()
        for k, i in enumerate(todo, 1):
            s, e = w.chunk_range(i)
            w.write_chunk(i, {"pooled": _rows(b, s, e, dim, seed)}, np.ones(e - s, bool))
            if k % 16 == 0 or k == len(todo):
                print(f"  {b}: {k}/{len(todo)} chunks in {time.perf_counter() - t0:.0f} s", flush=True)
        w.mark_complete()


def _heartbeat(which: str, every: float = 120.0) -> None:
    """Print, every ``every`` seconds to stderr, the arm's elapsed time and bytes read so far
    (``/proc/self/io`` rchar: the stored chunks it has decoded), so a long run shows progress."""
    import threading

    t0 = time.perf_counter()

    def beat() -> None:
        while True:
            time.sleep(every)
            try:
                with open("/proc/self/io") as fh:
                    rchar = next(int(ln.split()[1]) for ln in fh if ln.startswith("rchar"))
            except (OSError, StopIteration):
                rchar = -1
            print(
                f"  [{which}] {time.perf_counter() - t0:.0f} s, {rchar / 2**30:.2f} GiB read",
                file=sys.stderr,
                flush=True,
            )

    threading.Thread(target=beat, daemon=True).start()


def arm(store: str, which: str, max_memory: str) -> dict:
    _heartbeat(which)
    t0 = time.perf_counter()
    if which == "stream":
        from featcache.similarity import SimilarityConfig, run_similarity

        cfg = SimilarityConfig(
            cache=store, dataset="synth", split="test", measures="cka_linear,cka_debiased",
            max_memory=max_memory, progress=False,
        )  # fmt: skip
        df = run_similarity(cfg)
        vals = dict(zip(df["metric"].to_list(), df["value"].to_list(), strict=True))
    else:
        from featcache.store import open_cache

        c = open_cache(store)
        X = c.load("a", "synth", "test").X.astype(np.float64)
        Y = c.load("b", "synth", "test").X.astype(np.float64)
        vals = {"cka_linear": _notebook_cka(X, Y, False), "cka_debiased": _notebook_cka(X, Y, True)}
    return {"arm": which, "seconds": time.perf_counter() - t0, "vm_hwm_bytes": _vm_hwm(), **vals}


def _notebook_cka(x: np.ndarray, y: np.ndarray, debiased: bool) -> float:
    """google-research representation_similarity/Demo.ipynb ``feature_space_linear_cka``."""
    x = x - x.mean(0, keepdims=True)
    y = y - y.mean(0, keepdims=True)
    xty, xx, yy = np.linalg.norm(x.T @ y) ** 2, np.linalg.norm(x.T @ x), np.linalg.norm(y.T @ y)
    if debiased:
        n = x.shape[0]
        rx, ry = np.einsum("ij,ij->i", x, x), np.einsum("ij,ij->i", y, y)
        sx, sy = rx.sum(), ry.sum()

        def h(v, a, b, na, nb):
            return v - n / (n - 2.0) * a.dot(b) + na * nb / ((n - 1) * (n - 2))

        xty, xx, yy = h(xty, rx, ry, sx, sy), np.sqrt(h(xx**2, rx, rx, sx, sx)), np.sqrt(h(yy**2, ry, ry, sy, sy))
    return float(xty / (xx * yy))


def run_arm(store: str, which: str, max_memory: str) -> dict:
    cmd = [sys.executable, __file__, "--arm", which, "--store", store, "--max-memory", max_memory]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)  # progress on stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _machine() -> dict:
    from featcache.core.cpu import cpu_model

    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "threads": os.environ.get("OMP_NUM_THREADS"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="rows of the split (default 100,000)")
    ap.add_argument("--dim", type=int, default=2048, help="feature width of both backbones (default 2048)")
    ap.add_argument("--arms", default="stream,numpy", help="stream,numpy (numpy needs ~4 x N x D x 8 bytes)")
    ap.add_argument("--max-memory", default="2GB", help="the stream arm's --max-memory (default 2GB)")
    ap.add_argument(
        "--store", default=None, help="a store of this script: written there (and kept) if absent (default: a temp dir)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm:
        print(json.dumps(arm(a.store, a.arm, a.max_memory)))
        return 0
    tmp = None if a.store else tempfile.mkdtemp(prefix="similarity-scale-")
    store = a.store or os.path.join(tmp, "synth.zarr")
    try:
        if tmp or not os.path.exists(store):
            t0 = time.perf_counter()
            write_store(store, a.n, a.dim, a.seed)
            print(f"wrote {a.n} x {a.dim} float16 x 2 backbones in {time.perf_counter() - t0:.1f} s", flush=True)
        before = _machine()
        res = [run_arm(store, w, a.max_memory) for w in a.arms.split(",") if w]
        out = {
            "n": a.n,
            "dim": a.dim,
            "max_memory": a.max_memory,
            "machine_before": before,
            "machine_after": _machine(),
        }
        out["arms"] = res
        for r in res:
            print(
                f"{r['arm']:>7}: {r['seconds']:8.1f} s  peak RSS {r['vm_hwm_bytes'] / 2**20:8.0f} MiB  "
                f"cka_linear {r['cka_linear']:.10f}  cka_debiased {r['cka_debiased']:.10f}"
            )
        by = {r["arm"]: r for r in res}
        if {"stream", "numpy"} <= set(by):
            s, m = by["stream"], by["numpy"]
            out["ratios"] = {"seconds": s["seconds"] / m["seconds"], "rss": s["vm_hwm_bytes"] / m["vm_hwm_bytes"]}
            print(f"stream/numpy: time {out['ratios']['seconds']:.2f}x, peak RSS {out['ratios']['rss']:.2f}x")
        print(f"CPU {before['cpu']} x{before['cpus']}, load {before['loadavg']} -> {out['machine_after']['loadavg']}")
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(out, fh, indent=1)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
