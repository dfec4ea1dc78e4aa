"""JPEG decode + preprocess throughput: PIL vs torchvision.io.decode_jpeg (vs nvJPEG on CUDA).

Writes real JPEG files into a temp dir (Fashion-MNIST items upscaled to 224-512 px, stored as
grayscale and as RGB, and scikit-image photos resized to 224-512 px), then times, per image,
what one extraction DataLoader worker does: ``decode_image(path)`` with the decoder under test,
then the shared resize/crop of lite0's eval transform at ``--input-size``
(:class:`featcache.data.preprocess.FastPreprocess`). Each decoder runs in its own child
process (one torch thread, as a worker) so its peak RSS is its own; rounds alternate the
order and the best round of each is reported, with the ratio vs PIL from the same run. The
children also check that both decoders give identical preprocessed arrays on every file.

    python benchmarks/jpeg_decode.py --n 300 --rounds 3 --json benchmarks/results/jpeg_decode.json

``--decode-only`` times the decode alone (no resize/crop), plus a ``tv-tensor`` arm: torchvision's
decode to a tensor without the hand-over to PIL that the shared resize needs (files read beforehand). ``--cuda`` adds batched nvJPEG
decode (decode only, device tensors; its pixels are not PIL's) when CUDA is available.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LITE0 = "tf_efficientnet_lite0"
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "cat", "immunohistochemistry")


def write_jpegs(root: Path, n: int, quality: int = 90) -> list[str]:
    """``n`` JPEG files: 2/3 Fashion-MNIST (gray and RGB), 1/3 photos; sizes 224..512 px."""
    import numpy as np
    from PIL import Image
    from skimage import data as skdata

    from featcache.data.readers import open_dataset

    fm = open_dataset("fashion-mnist")["test"]
    photos = [Image.fromarray(getattr(skdata, p)()) for p in PHOTOS]
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        w, h = (int(v) for v in rng.integers(224, 513, size=2))
        if i % 3 == 2:
            img = photos[i % len(photos)].resize((w, h), Image.BICUBIC)
        else:
            img = fm.load(i).resize((w, h), Image.BILINEAR)
            img = img.convert("RGB") if i % 3 == 1 else img
        p = root / f"{i:05d}.jpg"
        img.save(p, "JPEG", quality=quality)
        paths.append(str(p))
    return paths


def _fast(input_size: int):
    import timm

    from featcache.data.preprocess import split_transform
    from featcache.models.backbones import make_transform

    cfg = timm.data.resolve_model_data_config(timm.create_model(LITE0, pretrained=False))
    return split_transform(make_transform(cfg, input_size=input_size))


def child(args) -> None:
    """One arm in this process: prints a JSON line {arm, seconds, images_per_s, peak_rss_mb, digest}."""
    import hashlib

    import torch

    from featcache.data.decode import decode_image
    from featcache.data.source import ReadOptions

    torch.set_num_threads(1)
    paths = Path(args.files).read_text().split("\n")
    fast = _fast(args.input_size)
    if args.arm == "nvjpeg":
        from featcache.data.decode import decode_jpeg_batch

        blobs = [Path(p).read_bytes() for p in paths]
        decode_jpeg_batch(blobs[:8])  # warm up CUDA
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, len(blobs), 64):
            decode_jpeg_batch(blobs[i : i + 64])
        torch.cuda.synchronize()
        secs, digest = time.perf_counter() - t0, ""
    elif args.arm == "tv-tensor":  # decode to a tensor only: no hand-over to PIL (not the pipeline's path)
        from torchvision.io import decode_jpeg

        blobs = [Path(p).read_bytes() for p in paths]
        h = hashlib.sha256()
        t0 = time.perf_counter()
        for b in blobs:
            h.update(decode_jpeg(torch.frombuffer(bytearray(b), dtype=torch.uint8)).permute(1, 2, 0).numpy())
        secs, digest = time.perf_counter() - t0, ""
    else:
        opts = ReadOptions(decoder=args.arm)
        import numpy as np

        prep = (lambda im: np.asarray(im)) if args.decode_only else fast
        for p in paths[:8]:  # warm up (imports, first calls)
            prep(decode_image(p, opts))
        h = hashlib.sha256()
        t0 = time.perf_counter()
        for p in paths:
            h.update(np.ascontiguousarray(prep(decode_image(p, opts))))
        secs, digest = time.perf_counter() - t0, h.hexdigest()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "arm": args.arm,
                "seconds": secs,
                "images_per_s": len(paths) / secs,
                "peak_rss_mb": round(peak, 1),
                "digest": digest,
            }
        )
    )


def run_arm(arm: str, files: Path, input_size: int, decode_only: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", arm, "--files", str(files), "--input-size", str(input_size)]
    out = subprocess.run(cmd + (["--decode-only"] if decode_only else []), capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="JPEG files to write and decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-size", type=int, default=224)
    ap.add_argument("--decode-only", action="store_true", help="time the decode alone (no resize/crop)")
    ap.add_argument("--cuda", action="store_true", help="also time batched nvJPEG decode")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", dest="arm", help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        return child(args)
    arms = ["pil", "torchvision"] + (["tv-tensor"] if args.decode_only else []) + (["nvjpeg"] if args.cuda else [])
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_jpegs(Path(tmp), args.n)
        files = Path(tmp) / "files.txt"
        files.write_text("\n".join(paths))
        samples: dict[str, list[dict]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for a in arms if r % 2 == 0 else arms[::-1]:
                samples[a].append(run_arm(a, files, args.input_size, args.decode_only))
                print(f"round {r} {a}: {samples[a][-1]['images_per_s']:.0f} img/s", file=sys.stderr)
    best = {a: max(s, key=lambda d: d["images_per_s"]) for a, s in samples.items()}
    digests = {s["digest"] for a in ("pil", "torchvision") for s in samples[a]}
    result = {
        "benchmark": "jpeg_decode",
        "n_files": args.n,
        "rounds": args.rounds,
        "input_size": args.input_size,
        "measures": "decode" if args.decode_only else "decode + resize/crop (lite0 eval transform)",
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "images_per_s": {a: round(b["images_per_s"], 1) for a, b in best.items()},
        "ratio_vs_pil": {a: round(b["images_per_s"] / best["pil"]["images_per_s"], 3) for a, b in best.items()},
        "peak_rss_mb": {a: max(s["peak_rss_mb"] for s in samples[a]) for a in arms},
        "identical_outputs": len(digests) == 1,
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
