"""Benchmark: the hummingbird solver's neighbour search (``featcache.dense.hbird``: FAISS exact
inner product, ``IndexFlatIP``, built by ``build_index`` over the L2-normalised memory) against a
plain PyTorch loop (``q @ memory.T`` then ``torch.topk``) over the same memory and queries.

Memory and queries: ``probe_scale.py``'s synthetic clustered rows (float16 as stored; --images
training images x --epochs views x --grid^2 patches of --dim dims, and --queries images' patches),
so the sizes are a real run's (the default: 500 images, 2 epochs, a 7x7 grid, ViT-S's 384
dims) without a backbone pass; the search does not depend on what the vectors mean. Each arm
runs in a fresh process (its own peak resident set, Linux ``VmHWM``) at --threads threads
(torch and FAISS), searching the queries in blocks of --batch images as the solver does:

* ``faiss``: ``build_index`` + ``index.search`` (what ``hummingbird`` runs, ``--index exact``);
* ``topk``: the float32 product block by block and ``torch.topk`` (the bare loop);
* ``topk-bf16``: the same in bfloat16, only where the CPU has bf16 units (``avx512_bf16`` /
  ``amx_bf16``); elsewhere the line says so, and the bf16 agreement (recall of the float32
  neighbours, emulated) is still printed, without a time.

Prints each arm's wall and CPU seconds of the search (and of the index build), the ratios
against the torch loop measured in the same run, the neighbour agreement (the share of queries
whose k neighbours are the same set, and the recall of the float32 loop's neighbours), peak RSS
(and the peak before the search: the interpreter, torch, FAISS and the rows), the CPU (lscpu) and the load (uptime).

    python benchmarks/hbird_search.py --images 500 --epochs 2 --queries 100 --dim 384 --threads 1
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


def _rows(a: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    from probe_scale import stored_rows

    t = a.grid * a.grid
    mem = stored_rows(0, 0, a.images * a.epochs * t, a.dim, 50, 0.15)[0]
    q = stored_rows(1, 10**8, a.queries * t, a.dim, 50, 0.15)[0]
    return mem, q


def _memory(mem16: np.ndarray):
    import torch

    from featcache.dense.hbird import HbirdMemory

    f = torch.from_numpy(mem16.astype(np.float32))
    f = f / torch.norm(f, dim=1, keepdim=True)
    return HbirdMemory(f, torch.zeros(len(f), 1), 0, 0)


def _search(name: str, a: argparse.Namespace, memory, q: np.ndarray) -> tuple[np.ndarray, float]:
    """The arm's neighbour indices of every query (blocks of --batch images) and its build time."""
    import torch

    from featcache.dense.hbird import HbirdSettings, build_index

    block = a.batch * a.grid * a.grid
    out, t0 = [], time.perf_counter()
    if name == "faiss":
        index = build_index(memory, HbirdSettings(k=a.k), 0)
        build = time.perf_counter() - t0
        for i in range(0, len(q), block):
            out.append(index.search(np.ascontiguousarray(q[i : i + block], np.float32), a.k)[1])
        return np.concatenate(out), build
    dt = torch.bfloat16 if name == "topk-bf16" else torch.float32
    m = memory.features.to(dt)
    for i in range(0, len(q), block):
        s = torch.from_numpy(q[i : i + block].astype(np.float32)).to(dt) @ m.T
        out.append(torch.topk(s.float(), a.k, dim=1).indices.numpy())
    return np.concatenate(out), 0.0


def arm(name: str, a: argparse.Namespace, out: str) -> dict:
    import faiss
    import torch
    from probe_scale import _vm_hwm

    torch.set_num_threads(a.threads)
    faiss.omp_set_num_threads(a.threads)
    mem16, q = _rows(a)
    memory = _memory(mem16)
    if name == "topk-bf16-agreement":  # emulated where no bf16 units: recall only, no time
        q = q[: a.batch * a.grid * a.grid]
        name = "topk-bf16"
    before = _vm_hwm()
    w, c = time.perf_counter(), time.process_time()
    idx, build = _search(name, a, memory, q)
    r = {"arm": name, "seconds": time.perf_counter() - w, "cpu_seconds": time.process_time() - c}
    r.update(build_seconds=build, vm_hwm_bytes=_vm_hwm(), before_search_bytes=before, memory_rows=len(mem16))
    r["queries"] = len(q)
    np.save(out, idx)
    return r


def _same_sets(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([set(x) == set(y) for x, y in zip(a, b, strict=True)]))


def _recall(a: np.ndarray, ref: np.ndarray) -> float:
    """The mean share of each query's reference neighbours that ``a`` found too."""
    return float(np.mean([len(set(x) & set(y)) / len(y) for x, y in zip(a, ref, strict=True)]))


def _run(name: str, a: argparse.Namespace, tmp: str) -> dict:
    cmd = [sys.executable, __file__, "--arm", name, "--out", os.path.join(tmp, name + ".npy")]
    for k in ("images", "epochs", "grid", "dim", "queries", "k", "batch", "threads"):
        cmd.append(f"--{k}={getattr(a, k)}")
    r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
    r["uptime"] = os.popen("uptime").read().strip()
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=500, help="training images (memory = images x epochs x grid^2)")
    ap.add_argument("--epochs", type=int, default=2, help="stored views (the reference's augmentation epochs)")
    ap.add_argument("--grid", type=int, default=7, help="token grid side")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=100, help="query images (each grid^2 patches)")
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64, help="query images per search block (the solver's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sys.path.insert(0, HERE)
    if a.arm:
        print(json.dumps(arm(a.arm, a, a.out)))
        return 0
    from featcache.core.cpu import bf16_support, cpu_model

    has_bf16, why = bf16_support()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); bf16: {why}")
    tmp = tempfile.mkdtemp(prefix="featcache-hbird-search-")
    names = ["topk", "faiss"] + (["topk-bf16"] if has_bf16 else [])
    runs = {n: _run(n, a, tmp) for n in names}
    idx = {n: np.load(os.path.join(tmp, n + ".npy")) for n in names}
    ref = runs["topk"]
    print(f"memory {ref['memory_rows']} x {a.dim}, {ref['queries']} query patches, k={a.k}, threads={a.threads}")
    for n, r in runs.items():
        agree, rec = _same_sets(idx[n], idx["topk"]), _recall(idx[n], idx["topk"])
        print(
            f"{n:10s} search {r['seconds']:7.2f} s wall {r['cpu_seconds']:7.2f} s CPU  "
            f"(index build {r['build_seconds']:.2f} s)  {ref['seconds'] / r['seconds']:5.2f}x the torch.topk loop "
            f"(CPU {ref['cpu_seconds'] / r['cpu_seconds']:5.2f}x)  same neighbour sets {agree:.4f} recall@{a.k} {rec:.4f}  "
            f"peak RSS {r['vm_hwm_bytes'] / 1e9:5.2f} GB (before the search {r['before_search_bytes'] / 1e9:4.2f})  {r['uptime']}"
        )
    if not has_bf16:
        r = _run("topk-bf16-agreement", a, tmp)
        emu = np.load(os.path.join(tmp, "topk-bf16-agreement.npy"))
        rec = _recall(emu, idx["topk"][: len(emu)])
        print(f"topk-bf16  not timed (no bf16 units: emulated); recall@{a.k} of the float32 neighbours {rec:.4f} "
              f"on {len(emu)} query patches, same sets {_same_sets(emu, idx['topk'][: len(emu)]):.4f}")  # fmt: skip
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "runs": runs}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
