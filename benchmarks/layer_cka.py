"""Benchmark: the layer-by-layer CKA grid (``featcache similarity --layers``) with each layer's
statistics computed once, against the pairwise loop (one streamed linear CKA per layer pair,
what running ``featcache similarity --kind layer{i}_...`` pair by pair would do), in one run.

The store (written through featcache's writer) holds one split of N rows for two synthetic
backbones with per-layer kinds ``layer{i}_cls`` (float16): layer ``i`` of backbone ``a`` is
``tanh(z @ W_ai) + 0.5 e``, of ``b`` ``tanh(z @ W_bi) + 0.5 e`` with a shared latent ``z`` (64-d),
so the layers are related and CKA sits well inside (0, 1). Each arm runs in a fresh process
(its own peak resident set, Linux ``VmHWM``) on lazy stored views, A's layers against B's:

- ``pairwise``: for every layer pair, :class:`~featcache.similarity.streaming.LinearCKAStream`
  over the pair's row blocks (each layer read, and its ``[d, d]`` product formed, once per pair);
- ``grid``: :func:`~featcache.similarity.layer_runner.layer_grids` (route chosen by cost and
  memory), and the two routes forced: ``features`` (one pass, every pair's cross-product from
  one product of the layers side by side) and ``gram`` (each layer's ``[n, n]`` Gram once).

Prints seconds, peak RSS and the largest difference to the pairwise values per arm, and the
ratio pairwise / arm; the CPU model and load beside them.

    python benchmarks/layer_cka.py --n 2000 --dims-a 384x12 --dims-b 384x12
    python benchmarks/layer_cka.py --n 4000 --dims-a 16,24,40,112,320 --dims-b 16,24,40,112,320
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

ARMS = ("pairwise", "grid", "features", "gram")


def _vm_hwm() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return -1


def _dims(text: str) -> list[int]:
    """``384x12`` (12 layers of 384) or a comma list of widths."""
    if "x" in text:
        d, k = text.split("x")
        return [int(d)] * int(k)
    return [int(t) for t in text.split(",")]


def write_store(path: str, n: int, dims: dict[str, list[int]], seed: int) -> None:
    from featcache.core.layers import layer_kind
    from featcache.store import FeatureWriter, ensure_split, make_provenance, open_cache

    cache = open_cache(path, "a")
    ids = np.array([f"row-{i:07d}" for i in range(n)])
    meta = ensure_split(cache, "synth", "test", ids, np.zeros(n, np.int64), ["c0"], "synthetic")
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((n, 64)).astype(np.float32)
    for b, ds in dims.items():
        X = {
            layer_kind(i, "cls"): (
                np.tanh(z @ rng.standard_normal((64, d), np.float32) / 8)
                + 0.5 * rng.standard_normal((n, d), np.float32)
            ).astype(np.float16)
            for i, d in enumerate(ds)
        }
        provs = {
            k: make_provenance(
                backbone=b,
                dataset="synth",
                split="test",
                kind=k,
                dim=x.shape[1],
                n=n,
                dataset_fingerprint=meta.fingerprint,
                chunk_rows=4096,
            )
            for k, x in X.items()
        }
        w = FeatureWriter(cache, b, "synth", "test", provs).prepare()
        try:
            for c in w.pending_chunks():
                s, e = w.chunk_range(c)
                w.write_chunk(c, {k: x[s:e] for k, x in X.items()}, np.ones(e - s, bool))
            w.mark_complete()
        finally:
            w.release()


def _views(path: str, b: str) -> list:
    from featcache.store import open_cache

    c = open_cache(path)
    return [
        c.load(b, "synth", "test", k, lazy=True).X
        for k in sorted(c.kinds(b, "synth", "test"), key=lambda k: int(k[5:].split("_")[0]))
    ]


def run_arm(arm: str, path: str, memory: str) -> dict:
    from featcache.core.memory import parse_memory
    from featcache.similarity import SimilarityConfig
    from featcache.similarity.layer_runner import layer_grids
    from featcache.similarity.layers import grid_sums
    from featcache.similarity.registry import Budget
    from featcache.similarity.streaming import LinearCKAStream, paired_blocks

    A, B = _views(path, "a"), _views(path, "b")
    t0 = time.perf_counter()
    if arm == "pairwise":
        M = np.zeros((len(A), len(B)))
        for i, x in enumerate(A):
            for j, y in enumerate(B):
                s = LinearCKAStream()
                for bx, by in paired_blocks(x, y, Budget(parse_memory(memory), x.shape[1], y.shape[1]).block_rows):
                    s.update(bx, by)
                M[i, j] = s.result()
        route = "pairwise"
    elif arm == "grid":
        mats, info = layer_grids(A, B, SimilarityConfig(cache=path, dataset="synth", layers="all", max_memory=memory))
        M, route = mats["cka_linear"], info["route"]
    else:
        rows = Budget(parse_memory(memory), sum(v.shape[1] for v in A), sum(v.shape[1] for v in B)).block_rows
        M, route = grid_sums(A, B, arm, parse_memory(memory), rows).cka(), arm
    secs = time.perf_counter() - t0
    return {"arm": arm, "route": route, "seconds": secs, "peak_rss": _vm_hwm(), "values": M.tolist()}


def _machine() -> str:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith("Model name")
        ),
        "?",
    )
    return f"cpu: {cpu}, {os.cpu_count()} logical CPUs; load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--dims-a", default="384x12")
    p.add_argument("--dims-b", default="384x12")
    p.add_argument("--max-memory", default="2GB")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--arm", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.arm:  # a child process: one arm
        print(json.dumps(run_arm(a.arm, a.store, a.max_memory)))
        return 0
    tmp = tempfile.mkdtemp(prefix="layer-cka-bench-")
    try:
        store = os.path.join(tmp, "s.zarr")
        write_store(store, a.n, {"a": _dims(a.dims_a), "b": _dims(a.dims_b)}, a.seed)
        print(f"layer CKA grid, N={a.n}, A layers {a.dims_a}, B layers {a.dims_b}, --max-memory {a.max_memory}")
        print(_machine())
        out = []
        for arm in a.arms.split(","):
            cmd = [sys.executable, __file__, "--arm", arm, "--store", store, "--max-memory", a.max_memory]
            out.append(
                json.loads(
                    subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
                )
            )
        ref = next((r for r in out if r["arm"] == "pairwise"), out[0])
        for r in out:
            diff = float(np.abs(np.array(r["values"]) - np.array(ref["values"])).max())
            ratio = ref["seconds"] / r["seconds"]
            print(
                f"{r['arm']:>9} ({r['route']:>8}): {r['seconds']:7.2f} s  peak RSS {r['peak_rss'] / 2**20:7.1f} MiB  {ref['arm']}/this {ratio:5.2f}x  max |diff| {diff:.1e}"
            )
        print(_machine())
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(
                    {
                        "n": a.n,
                        "dims_a": a.dims_a,
                        "dims_b": a.dims_b,
                        "arms": [{k: v for k, v in r.items() if k != "values"} for r in out],
                    },
                    fh,
                    indent=1,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
